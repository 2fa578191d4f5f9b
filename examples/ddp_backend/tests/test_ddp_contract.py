"""ddp keeps every promise agl asks of a backend (the shipped contract suite, on its default recording:
three steps of the tiny task, recorded with the reference backend)."""

import agl_ddp_backend

from agl_core.testing.contracts import BackendContract


class TestDdpBackendContract(BackendContract):
    backend_name = "ddp"
    plugins = (agl_ddp_backend,)
