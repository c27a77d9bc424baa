"""Bytes in and out of a store: where its objects live (``backends``: local disk, S3, HTTP, each one backend of
one protocol), storage URLs and filesystems (``storage``), listings (``listing``), the one
guarded way of reading (``door``) and what it receives from a server (``receive``), batched transfers
(``transfer``), writes that follow no link (``sinks``, ``destination``), safetensors files (``tensorfiles``)
and host buffers (``memory``).

Imports: hsstore core.
"""
