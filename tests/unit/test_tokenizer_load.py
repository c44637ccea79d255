"""Tokenizer.load: files, config fields, special tokens, templates; the id helpers."""

from __future__ import annotations

import json
import lzma
import shutil
from pathlib import Path

import pytest

from shepherd.tokens.chat_messages import ChatTemplateError
from shepherd.tokens.tokenizer import VERY_LARGE_INTEGER, Tokenizer
from tests.unit.test_tokenizer_shared import llama, qwen3

ROOT = Path(__file__).resolve().parents[2]
TOK = ROOT / "tests" / "assets" / "tokenizers"
QWEN3 = ROOT / "shepherd" / "tokens" / "assets" / "qwen3"


def gpt2_dir(tmp_path: Path, config: dict[str, object] | None = None, *, plain: bool = False) -> Path:
    d = tmp_path / "model"
    d.mkdir(parents=True)
    if plain:
        with lzma.open(TOK / "gpt2" / "tokenizer.json.xz", "rb") as f:
            (d / "tokenizer.json").write_bytes(f.read())
    else:
        shutil.copy(TOK / "gpt2" / "tokenizer.json.xz", d)
    cfg = json.loads((TOK / "gpt2" / "tokenizer_config.json").read_text())
    cfg.update(config or {})
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


def test_attributes_of_real_tokenizers() -> None:
    q = qwen3()
    assert (q.name, q.path, q.vocab_size) == ("qwen3", QWEN3, 151669)
    assert q.bos_token is None and q.eos_token == "<|im_end|>"
    assert q.eos_token_ids == (q.token_to_id("<|im_end|>"),)
    assert q.token_to_id("<|im_start|>") in q.special_token_ids
    assert q.token_to_id("<think>") not in q.special_token_ids  # an added token, not a special one
    assert q.model_max_length == 131072
    assert q.cache.segmenting
    lm = llama()
    assert lm.name == "llama" and lm.bos_token == "<|begin_of_text|>" and lm.eos_token == "<|eot_id|>"
    assert lm.eos_token_ids == (128009,) and lm.bos_token_id == 128000
    assert len(lm.special_token_ids) == 256 and lm.vocab_size == 128256


def test_ids_helpers() -> None:
    q = qwen3()
    text = "<|im_start|>user\nnaïve 日本語 🦙<|im_end|>"
    ids = q.encode(text)
    assert ids == q.encode_uncached(text) == q.hf.encode(text).ids
    assert q.decode(ids, skip_special_tokens=False) == text
    assert q.decode(ids) == "user\nnaïve 日本語 🦙"
    assert q.decode(tuple(ids), skip_special_tokens=False) == text
    assert q.id_to_token(q.token_to_id("<|im_end|>") or -1) == "<|im_end|>"
    assert q.token_to_id("definitely not a token ☃☃") is None
    assert q.id_to_token(10**9) is None


def test_plain_json_and_xz_load_the_same(tmp_path: Path) -> None:
    a = Tokenizer.load(gpt2_dir(tmp_path / "a", plain=True))
    b = Tokenizer.load(gpt2_dir(tmp_path / "b"))
    assert a.vocab_size == b.vocab_size == 50257
    assert a.encode("Hello world<|endoftext|>") == b.encode("Hello world<|endoftext|>") == [15496, 995, 50256]
    assert a.model_max_length == 1024 and a.eos_token_ids == (50256,)


def test_missing_tokenizer_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        Tokenizer.load(tmp_path)


def test_added_token_dicts_generation_config_and_no_limit(tmp_path: Path) -> None:
    d = gpt2_dir(
        tmp_path,
        {
            "bos_token": {"__type": "AddedToken", "content": "<|endoftext|>", "normalized": True},
            "eos_token": {"__type": "AddedToken", "content": "<|endoftext|>"},
            "model_max_length": 1000000000000000019884624838656,
        },
    )
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [50256, 13, 50256]}))
    t = Tokenizer.load(d)
    assert t.bos_token == t.eos_token == "<|endoftext|>"
    assert t.eos_token_ids == (50256, 13)
    assert t.model_max_length == VERY_LARGE_INTEGER
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 198}))
    assert Tokenizer.load(d).eos_token_ids == (50256, 198)


def test_no_template_is_a_clear_error(tmp_path: Path) -> None:
    t = Tokenizer.load(gpt2_dir(tmp_path))
    assert t.templates == {}
    with pytest.raises(ChatTemplateError, match="no chat template"):
        t.render_chat([{"role": "user", "content": "hi"}])


def test_named_templates_from_config_and_files(tmp_path: Path) -> None:
    d = gpt2_dir(
        tmp_path,
        {
            "chat_template": [
                {"name": "default", "template": "D{{ messages[0].content }}"},
                {"name": "tool_use", "template": "T{{ tools | length }}"},
            ]
        },
    )
    (d / "chat_template.rag.jinja").write_text("R{{ messages | length }}\n")
    t = Tokenizer.load(d)
    msgs = [{"role": "user", "content": "x"}]
    assert sorted(t.templates) == ["default", "rag", "tool_use"]
    assert t.render_chat(msgs) == "Dx"
    assert t.render_chat(msgs, tools=[{"type": "function"}]) == "T1"
    assert t.render_chat(msgs, template_name="rag") == "R1"  # jinja drops one trailing newline
    with pytest.raises(ChatTemplateError, match="no chat template named"):
        t.render_chat(msgs, template_name="nope")
    # chat_template.jinja beside the config wins over the config's default, as in transformers
    (d / "chat_template.jinja").write_text("J")
    assert Tokenizer.load(d).render_chat(msgs) == "J"


def test_explicit_template_override(tmp_path: Path) -> None:
    d = gpt2_dir(tmp_path, {"chat_template": "C"})
    (d / "chat_template.alt.jinja").write_text("ALT")
    other = tmp_path / "other.jinja"
    other.write_text("FILE{{ bos_token }}")
    msgs = [{"role": "user", "content": "x"}]
    assert Tokenizer.load(d).render_chat(msgs) == "C"
    assert Tokenizer.load(d, chat_template=other).render_chat(msgs) == "FILE<|endoftext|>"
    assert Tokenizer.load(d, chat_template=str(other)).render_chat(msgs) == "FILE<|endoftext|>"
    assert Tokenizer.load(d, chat_template="alt").render_chat(msgs) == "ALT"
    assert Tokenizer.load(d, chat_template="{{ 'S' }}").render_chat(msgs) == "S"
    with pytest.raises(FileNotFoundError):
        Tokenizer.load(d, chat_template="no-such-template")


def test_render_chat_uses_the_render_cache() -> None:
    q = qwen3()
    msgs = [{"role": "user", "content": "cache me"}]
    tpl = q.chat_template()
    before = tpl.hits
    assert q.render_chat(msgs) == q.render_chat(msgs)
    assert tpl.hits == before + 1
