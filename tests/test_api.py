"""The top-level API: one list of public names (qkv._EXPORTS) gives __all__, the lazy loader and, held equal by
this test, the imports type checkers read; names that left the top level still load, with a warning."""

from __future__ import annotations

import ast
import inspect
import warnings

import pytest

import qkv

MOVED = ["LMConfig", "MLMConfig", "TranslateConfig", "CopyConfig", "ReverseConfig"]


def _type_checking_names() -> dict[str, str]:
    """name → module of the imports under `if TYPE_CHECKING:` in qkv/__init__.py."""
    tree = ast.parse(inspect.getsource(qkv))
    block = next(n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING")
    return {a.name: str(node.module) for node in block.body if isinstance(node, ast.ImportFrom) for a in node.names}


def test_all_is_the_export_list_and_type_checkers_see_the_same_names() -> None:
    exports = qkv._EXPORTS
    assert qkv.__all__ == sorted(exports)
    assert _type_checking_names() == exports
    assert set(dir(qkv)) == {*exports, "__version__"}


@pytest.mark.parametrize("name", sorted(qkv._EXPORTS))
def test_every_public_name_loads_from_its_room(name: str) -> None:
    """Each name is the object its module defines, documented in a line."""
    value = getattr(qkv, name)
    module = __import__(qkv._EXPORTS[name], fromlist=[name])
    assert value is getattr(module, name)
    assert (inspect.getdoc(value) or "").strip(), f"qkv.{name} has no docstring"


def test_the_parts_the_notes_name_are_exported() -> None:
    """Latent attention, the masks, the norms and the positions are at the top level."""
    for name in ("LatentAttention", "causal_mask", "padding_mask_from_ids", "RMSNorm",
                 "LayerNorm", "RotaryEmbedding", "SinusoidalPositionalEncoding", "generate"):  # fmt: skip
        assert name in qkv.__all__
    assert not [n for n in qkv.__all__ if n in MOVED]  # the toy task configs left


@pytest.mark.parametrize("name", MOVED)
def test_names_that_left_the_top_level_still_load_with_a_deprecation_warning(name: str) -> None:
    with pytest.warns(DeprecationWarning, match=rf"qkv\.{name} has moved: import it from qkv\.tasks\."):
        value = getattr(qkv, name)
    assert value is getattr(__import__(qkv._MOVED[name], fromlist=[name]), name)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert qkv.DecoderLMConfig is not None  # a current name warns nothing
    with pytest.raises(AttributeError, match="has no attribute 'Nope'"):
        qkv.Nope  # noqa: B018
