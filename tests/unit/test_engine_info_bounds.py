"""What a broken or hostile engine reports about itself is bounded before the node uses it: TensorRT-LLM's
GetModelInfo (context, vocabulary, name)."""

from __future__ import annotations

import pytest
from smg_grpc_proto import trtllm_service_pb2 as tr

from shepherd.proto.engine_types import EngineError, GenerateRequest, SamplingParams
from shepherd.proto.trtllm_codec import MAX_VOCAB, decode_trtllm_model_info, trtllm_generate


@pytest.mark.parametrize(
    ("seq", "vocab", "ctx_want", "vocab_want"),
    [
        (4096, 32000, 4096, 32000),
        (-7, -5, 0, 0),
        (2**31 - 1, MAX_VOCAB * 4, 2**31 - 1, 0),
        (0, MAX_VOCAB + 1, 0, 0),
    ],
)
def test_trtllm_model_info_takes_absurd_numbers_as_unknown(
    seq: int, vocab: int, ctx_want: int, vocab_want: int
) -> None:
    info = decode_trtllm_model_info(
        tr.GetModelInfoResponse(model_id="m\x1b[31m\n", max_seq_len=seq, vocab_size=vocab)
    )
    assert (info.max_context_length, info.vocab_size) == (ctx_want, vocab_want)
    assert info.served_model_name == "m[31m"


def test_trtllm_logit_bias_needs_a_sane_vocabulary() -> None:
    """A logit_bias vector is the vocabulary's length: never built from an absurd size."""
    req = GenerateRequest("r", [1, 2], SamplingParams(max_new_tokens=4, logit_bias=((3, 1.0),)), True)
    assert len(trtllm_generate(req, 100).embedding_bias) == 100
    with pytest.raises(EngineError):
        trtllm_generate(req, 2**31)
