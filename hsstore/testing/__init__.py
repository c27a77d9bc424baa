"""What tests of hsstore, and of a layout written outside it, share: ``layout_contract`` (the behaviour every
shard layout owes, as one base class of tests), ``backend_contract`` (the same for a storage backend),
``stores`` (small synthetic manifests, samples and stores), ``loading`` (datasets over them, the loader's options spelled flat), ``faultproxy`` (a fault-injecting HTTP
proxy for an S3 endpoint) and ``ports``. Shipped in the package so that tools/ and an outside layout use the
same helpers as tests/, without importing tests/. Needs the test extras (pytest, torch).

Imports: hsstore core, io, app, format, layouts, store, loader, ops.
"""
