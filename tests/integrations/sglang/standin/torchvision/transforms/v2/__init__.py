"""Part of the inert torchvision stand-in (see torchvision/__init__.py)."""

from torchvision import _Inert


def __getattr__(attr: str) -> _Inert:
    return _Inert(f"{__name__}.{attr}")
