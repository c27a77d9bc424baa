"""The applications' floor: what the command families (the store commands, extract/, train/) share above the
library: settings declared once with their flags (``schema``; what the families share, ``sections``; the store
commands' schemas, ``settings``) and config files (``config``), a command's one registration (``commands``), devices
and the CPU kernels' routing (``devices``), the CPU threads a model's work runs on (``threads``), the Gated DeltaNet
convolution hook (``conv``), the one target loader and tap capture (``target``), and the command line (``cli``). The library never imports it; extract/ and train/ import
it and never each other.

Imports: hsstore core, io, format, layouts, store, loader, ops.
"""
