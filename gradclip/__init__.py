"""``import gradclip``: the distribution's name, for gradclip_cli's public API.

The package installs as ``gradclip`` (``pip install gradclip``) and its code
lives in ``gradclip_cli``, the name the command's modules have always had;
this module gives the same public names under the distribution's name::

    import gradclip
    gradclip.clip_grad_norm_(model.parameters(), 1.0)
    report = gradclip.inspect("checkpoint-500/")

Every name is ``gradclip_cli``'s own object (``gradclip.GradMonitor is
gradclip_cli.GradMonitor``), loaded on first use as there. Submodules
(``gradclip_cli.integrations.transformers``) keep their ``gradclip_cli`` path.
"""

import gradclip_cli as _gradclip_cli

__version__ = _gradclip_cli.__version__
__all__ = list(_gradclip_cli.__all__)


def __getattr__(name: str):
    if name in __all__:
        return getattr(_gradclip_cli, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
