"""Names of the torchvision stand-in: callables that raise if called (text models never do)."""


def missing(module: str, name: str):  # type: ignore[no-untyped-def]
    if name.startswith("__"):
        raise AttributeError(name)

    def call(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise NotImplementedError(f"{module}.{name}: torchvision is not installed here")

    call.__name__ = name
    return call
