"""Import-only stand-in for ``sgl_kernel`` on the CPU, where no wheel of it exists.

SGLang imports CPU ops from it at start-up (``*_cpu`` and ``*_and_mul`` names) and falls back
to plain torch for norms, activations and rope when a name is missing. So those names exist
(and raise if ever called) and every other name is missing: answering every name would defeat
SGLang's own fallback detection.
"""


def _missing(name: str):  # type: ignore[no-untyped-def]
    def call(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise NotImplementedError(f"sgl_kernel.{name} has no CPU build in this environment")

    call.__name__ = name
    return call


def __getattr__(name: str):  # type: ignore[no-untyped-def]
    if name.endswith(("_cpu", "_and_mul")):
        return _missing(name)
    raise AttributeError(name)
