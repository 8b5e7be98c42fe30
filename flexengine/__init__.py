"""flexengine: long-context fine-tuning of HF causal LMs with FlexAttention document masks.

Public API:
    batch = flexengine.pack_documents(docs, seq_len=4096)   # dict of LongTensors [rows, seq_len]
    model = flexengine.patch_attention(model, mode="packed_doc", backend="auto")   # or, from configs:
    flexengine.apply_attention(model, flexengine.resolve_attention_spec(AttnConfig(...), model.config))

All are imported on first use: `import flexengine.cli.common` (every command's start) must not pay for torch and
transformers (measured: most of a command's start-up, see bench/results/startup.md).
"""

import importlib.util
import sys
from importlib import import_module
from pathlib import Path

__all__ = ["apply_attention", "pack_documents", "patch_attention", "resolve_attention_spec"]
__version__ = "0.1.0"

_LAZY = {
    "pack_documents": "flexengine.data.packing",
    "patch_attention": "flexengine.surgery.attention.patch",
    "apply_attention": "flexengine.surgery.attention.patch",
    "resolve_attention_spec": "flexengine.surgery.attention.spec",
}


def __getattr__(name: str):
    """PEP 562: import the public functions when first asked for."""
    if name in _LAZY:
        value = getattr(import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'flexengine' has no attribute {name!r}")


def _import_checkout_conf() -> None:
    """In a source checkout (editable install, PYTHONPATH, `python -m` from the repository root) the configs are
    the top-level conf/: import it as flexengine.conf, which is where an installed wheel has them (setuptools'
    package-dir maps conf/ to flexengine/conf/). Hydra's pkg://flexengine.conf then works the same everywhere."""
    here = Path(__file__).resolve().parent
    checkout_conf = here.parent / "conf"
    if (here / "conf" / "config.yaml").is_file() or not (checkout_conf / "config.yaml").is_file():
        return
    spec = importlib.util.spec_from_file_location(
        "flexengine.conf", checkout_conf / "__init__.py", submodule_search_locations=[str(checkout_conf)]
    )
    assert spec is not None and spec.loader is not None  # a .py file's location always gives a loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["flexengine.conf"] = module
    spec.loader.exec_module(module)
    globals()["conf"] = module


_import_checkout_conf()
