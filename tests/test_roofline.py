import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from cbkit.measure.roofline import Shape, decode_step, matmul_params, rollout_roofline
from cbkit.telemetry import kv_bytes_per_token


def _config(**kw):
    base = dict(vocab_size=100, hidden_size=16, intermediate_size=40, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, tie_word_embeddings=False)
    return LlamaConfig(**{**base, **kw})


@pytest.mark.parametrize("tied", [False, True])
def test_matmul_params_count_the_models_linear_weights(tied):
    config = _config(tie_word_embeddings=tied)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    assert Shape.of(config).matmul_params == matmul_params(model)


def test_a_decode_step_worked_by_hand():
    # 1 layer, hidden 8, 2 heads of 4, 1 kv head, mlp 10, vocab 20: matmul params = q 32 + o 32 + k 32 + v 32... by hand:
    # q: 8x8=64, o: 64, k: 8x4=32, v: 32, mlp: 3x8x10=240, head: 20x8=160 -> 592.
    config = _config(vocab_size=20, hidden_size=8, intermediate_size=10, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=1)
    shape = Shape.of(config)
    assert shape.matmul_params == 592
    cost = decode_step(config, [3, 5], dtype_bytes=2)
    # FLOPs: 2 x 592 x 2 rows + attention 4 x 1 layer x 2 heads x 4 dims x (3 + 5) = 2368 + 256
    assert cost.flops == 2368 + 256
    # bytes: weights (592 + 8 x 2 embedding rows) x 2, KV: 1 layer x 2 x 1 head x 4 x 2 bytes = 16 per token x 8 tokens
    assert cost.bytes == (592 + 16) * 2 + 16 * 8


def test_the_lower_roof_binds_and_rows_drop_out_as_completions_end():
    config = _config()
    shape = Shape.of(config)
    fast_compute = rollout_roofline(config, prompt_lens=[4], completion_lengths=[2, 1], dtype_bytes=4,
                                    peak_flops=1e30, bytes_per_s=1.0)
    # Bandwidth-bound everywhere: the time is the bytes read. Step 0 runs both rows, step 1 only the first.
    expected = (shape.matmul_params * 4 + kv_bytes_per_token(config, 4) * 4) \
        + decode_step(config, [4, 4], 4).bytes + decode_step(config, [5], 4).bytes
    assert fast_compute["roof_seconds"] == pytest.approx(expected)
    assert fast_compute["decode_steps"] == 2 and fast_compute["compute_bound_steps"] == 0
    assert fast_compute["attainable_tokens_per_s"] == pytest.approx(3 / expected)
    fast_memory = rollout_roofline(config, prompt_lens=[4], completion_lengths=[2, 1], dtype_bytes=4,
                                   peak_flops=1.0, bytes_per_s=1e30)
    assert fast_memory["compute_bound_steps"] == 2


def test_bad_peaks_are_refused():
    with pytest.raises(ValueError, match="positive peaks"):
        rollout_roofline(_config(), prompt_lens=[4], completion_lengths=[1], dtype_bytes=4, peak_flops=0,
                         bytes_per_s=1)
