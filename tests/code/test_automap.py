"""auto_map parsing: shapes, nested sub-configs, and every malformed entry."""

from __future__ import annotations

import json

import pytest

from codeferry._code.automap import ClassRef, parse_auto_maps, parse_reference
from codeferry.errors import InvalidAutoMapError, ShadowingModuleError, UnsafePathError


def refs(data: dict[str, object], filename: str = "config.json") -> list[ClassRef]:
    text = json.dumps(data, indent=2)
    return parse_auto_maps(data, filename=filename, path=f"/m/{filename}", text=text)


def test_plain_pair_and_cross_repo_entries() -> None:
    found = refs({"auto_map": {
        "AutoConfig": "configuration_x.XConfig",
        "AutoTokenizer": ["tokenization_x.XTokenizer", None],
        "AutoModel": "org/other--modeling_y.YModel",
    }})
    assert [(r.key, r.slot, r.repo, r.module, r.name) for r in found] == [
        ("AutoConfig", None, None, "configuration_x", "XConfig"),
        ("AutoTokenizer", 0, None, "tokenization_x", "XTokenizer"),
        ("AutoModel", None, "org/other", "modeling_y", "YModel"),
    ]
    assert found[2].reference == "org/other--modeling_y.YModel"


def test_nested_sub_config_auto_map_is_read_with_its_key_path() -> None:
    found = refs({
        "auto_map": {"AutoConfig": "configuration_x.XConfig"},
        "llm_config": {"auto_map": {"AutoConfig": "configuration_llm.LLMConfig"},
                       "vision": {"auto_map": {"AutoConfig": "vis.VisConfig"}}},
    })
    assert [r.declared_in for r in found] == ["config.json", "config.json:llm_config",
                                         "config.json:llm_config.vision"]


def test_legacy_tokenizer_list_form() -> None:
    found = refs({"auto_map": ["tokenization_x.Slow", "tokenization_x.Fast"]}, "tokenizer_config.json")
    assert [(r.key, r.slot) for r in found] == [("AutoTokenizer", 0), ("AutoTokenizer", 1)]


@pytest.mark.parametrize("auto_map", [["a.B"], "a.B", 3, None])
def test_auto_map_of_the_wrong_type(auto_map: object) -> None:
    with pytest.raises(InvalidAutoMapError) as info:
        refs({"model_type": "x", "auto_map": auto_map})
    assert info.value.path == "/m/config.json"
    assert info.value.line == 3
    assert "auto_map" in str(info.value) and info.value.fix


@pytest.mark.parametrize("value", ["nodot", "modeling x.Model", "1mod.Class", "mod.", ".Class", ["a.B", 3]])
def test_malformed_entries(value: object) -> None:
    with pytest.raises(InvalidAutoMapError) as info:
        refs({"auto_map": {"AutoModel": value}})
    assert info.value.line == 3


@pytest.mark.parametrize("value", ["../x.Class", "/etc/passwd.Class", "sub/x.Class", "..x.Class"])
def test_entries_escaping_the_folder(value: str) -> None:
    with pytest.raises(UnsafePathError):
        parse_reference(value, path="config.json", line=1)


@pytest.mark.parametrize("value", ["json.Config", "os.path.Model", "transformers.Model", "torch.Thing"])
def test_entries_shadowing_installed_modules(value: str) -> None:
    with pytest.raises(ShadowingModuleError) as info:
        parse_reference(value, path="config.json", line=7)
    assert info.value.line == 7 and "rename" in (info.value.fix or "")


def test_invalid_repo_id() -> None:
    with pytest.raises(InvalidAutoMapError):
        parse_reference("org/../x--mod.Class", path="config.json", line=1)
