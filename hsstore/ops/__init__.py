"""Operations on whole stores, one module per command: ``info``, ``verify``, ``subset``, ``merge``,
``convert``, ``upgrade``, ``bench``, ``estimate`` and the HTML ``report`` (``html_report``); ``stats`` is the
per-sample distributions that ``info`` and the extraction gate show.

Imports: hsstore core, io, format, layouts, store, loader.
"""
