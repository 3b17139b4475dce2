import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from cbkit.measure.probe import matmul_params
from cbkit.measure.roofline import (
    GPUS,
    Shape,
    decode_step,
    estimated_rollout_seconds,
    estimated_step_split,
    rollout_roofline,
    teacher_forced_forward,
    training_roofline,
)


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
    cost = decode_step(shape, [3, 5], dtype_bytes=2)
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
    expected = (shape.matmul_params * 4 + shape.kv_bytes_per_token(4) * 4) \
        + decode_step(shape, [4, 4], 4).bytes + decode_step(shape, [5], 4).bytes
    assert fast_compute["roof_seconds"] == pytest.approx(expected)
    assert fast_compute["decode_steps"] == 2 and fast_compute["compute_bound_steps"] == 0
    assert fast_compute["attainable_tokens_per_s"] == pytest.approx(3 / expected)
    fast_memory = rollout_roofline(config, prompt_lens=[4], completion_lengths=[2, 1], dtype_bytes=4,
                                   peak_flops=1.0, bytes_per_s=1e30)
    assert fast_memory["compute_bound_steps"] == 2


def test_bad_peaks_are_refused_and_datasheet_gpus_say_so():
    with pytest.raises(ValueError, match="positive peaks"):
        rollout_roofline(_config(), prompt_lens=[4], completion_lengths=[1], dtype_bytes=4, peak_flops=0,
                         bytes_per_s=1)
    assert all(m.source == "datasheet" for m in GPUS.values())
    with pytest.raises(ValueError, match="no peak for 'bfloat16'"):
        GPUS["t4"].flops("bfloat16")


def test_the_training_phases_roofs_worked_by_hand():
    """The 592-matmul-parameter shape above (LM head 20 x 8 = 160 of them): one row of a 3-token prompt and a
    2-token completion, forwarded in one call."""
    config = _config(vocab_size=20, hidden_size=8, intermediate_size=10, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=1)
    cost = teacher_forced_forward(Shape.of(config), [(3, 2)], dtype_bytes=4, forwards=1)
    # body 432 params x 5 tokens x 2, head 160 x 3 positions (logits_to_keep = 2 + 1) x 2, attention 4 x 1 x 2 x 4
    # = 32 FLOPs a key, over 1 + 2 + 3 + 4 + 5 = 15 keys (causal)
    assert cost.flops == 2 * 432 * 5 + 2 * 160 * 3 + 32 * 15
    assert cost.bytes == 592 * 4
    # two chunks read the weights twice; the FLOPs are the tokens', the same however they are chunked
    two = teacher_forced_forward(Shape.of(config), [(3, 2), (3, 2)], dtype_bytes=4, forwards=2)
    assert two.flops == 2 * cost.flops and two.bytes == 2 * cost.bytes
    roofs = training_roofline(config, rows=[(3, 2)], forwards=1, params=700, dtype_bytes=4, peak_flops=1e3,
                              bytes_per_s=1e6)
    assert roofs["old_logprob_roof_s"] == pytest.approx(cost.flops / 1e3)  # compute-bound at these peaks
    # forward + backward = 3 forwards' FLOPs, then AdamW: 7 fp32 reads and writes a parameter
    assert roofs["update_roof_s"] == pytest.approx(3 * cost.flops / 1e3 + 700 * 28 / 1e6)
    assert roofs["update_compute_roof_s"] == pytest.approx(3 * cost.flops / 1e3)
    with pytest.raises(ValueError, match="positive peaks"):
        training_roofline(config, rows=[(3, 2)], forwards=1, params=700, dtype_bytes=4, peak_flops=0, bytes_per_s=1)


def test_the_estimated_step_split_differs_only_in_the_rollout():
    """Targets 1, 2 and 3: the static batch decodes 3 rows for 3 steps, the pool 3, 2, then 1; the training phases
    are the same work for both backends, the old-logprob forward a third of the update's FLOPs. On a machine slow
    enough that a step's compute beats the launch floor, the pool's shorter steps show."""
    from cbkit.measure.roofline import Machine

    config = _config()
    slow = Machine("slow", {"float16": 1e6, "float32": 1e6}, 1e12)
    kw = dict(prompt_lens=[4], machine=slow, rollout_dtype="float16", train_dtype="float32", dtype_bytes=2)
    split = estimated_step_split(config, targets=[1, 2, 3], **kw)
    g, c = split["generate"], split["continuous"]
    assert g["rollout_s"] == pytest.approx(estimated_rollout_seconds(
        config, prompt_lens=[4], running=[3, 3, 3], context=5, dtype_bytes=2, machine=slow, dtype="float16"))
    assert c["rollout_s"] == pytest.approx(estimated_rollout_seconds(
        config, prompt_lens=[4], running=[3, 2, 1], context=5, dtype_bytes=2, machine=slow, dtype="float16"))
    assert c["rollout_s"] < g["rollout_s"]
    # on a T4 this tiny shape is bound by the launch floor: every step costs the same, rows or not
    t4 = estimated_step_split(config, targets=[1, 2, 3], **{**kw, "machine": GPUS["t4"]})
    assert t4["continuous"]["rollout_s"] == pytest.approx(t4["generate"]["rollout_s"])
    assert g["update_s"] == c["update_s"] and g["old_logprob_s"] == pytest.approx(g["update_s"] / 3)
    same = estimated_step_split(config, targets=[3, 3, 3], **kw)  # no spread: nothing for CB to win back
    assert same["generate"]["rollout_s"] == pytest.approx(same["continuous"]["rollout_s"])


def test_rows_off_the_floor_worked_by_hand():
    """The 592-parameter layer above, fp16, bandwidth-bound (compute is free): a decode step at context 10 reads the
    weights (1184 bytes), each row's embedding (16) and 10 tokens of KV (160: 1 layer x k and v x 1 head x 4 dims x
    2 bytes), so it takes (1184 + 176 rows) bytes / (1e8 B/s x 0.5). It leaves the one-layer launch floor at the
    first row count past (floor x 5e7 - 1184) / 176; a GPU fast enough keeps every step on the floor."""
    import math

    from cbkit.measure.roofline import LAUNCH_S_PER_LAYER, Machine, rows_off_the_floor

    config = _config(vocab_size=20, hidden_size=8, intermediate_size=10, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=1)
    slow = Machine("slow", {"float16": 1e30}, 1e8)
    want = math.floor((LAUNCH_S_PER_LAYER * 1e8 * 0.5 - 1184) / 176) + 1
    assert 300 < want < 400
    assert rows_off_the_floor(config, context=10, dtype_bytes=2, machine=slow, dtype="float16") == want
    fast = Machine("fast", {"float16": 1e30}, 1e20)
    assert rows_off_the_floor(config, context=10, dtype_bytes=2, machine=fast, dtype="float16") is None


def test_the_estimate_table_gives_one_row_where_the_floor_hides_the_padding():
    """Llama-3.2-1B's shape at 256 rows of up to 2048 tokens: on an A100 every decode step is on the launch floor (one
    row, generate = CB, with the note naming it and where the floor ends), while a T4's bandwidth lets the padded
    rows show (a row per backend, CB's rollout the shorter)."""
    import random

    from cbkit.measure.tables import estimated_step_table, estimated_steps
    from cbkit.models.load import load_config

    config = load_config("llama-1b-random")
    rng = random.Random(0)
    lengths = {64: [rng.randint(100, 2048) for _ in range(256)]}
    rows = estimated_steps(config, prompt_lens=[132] * 4, lengths_by_n=lengths)
    by = {(r["gpu"], r["backend"]): r for r in rows}
    assert set(by) == {("t4", "generate"), ("t4", "continuous"), ("a100-40", "generate = CB")}
    assert by[("t4", "continuous")]["rollout_s"] < by[("t4", "generate")]["rollout_s"]
    assert by[("t4", "continuous")]["speedup"] > 1 and by[("a100-40", "generate = CB")]["speedup"] == 1
    table = estimated_step_table(config, prompt_lens=[132] * 4, lengths_by_n=lengths)
    assert table.count("| 64 |") == 3 and "| generate = CB |" in table
    note = table.splitlines()[-1]
    assert "on the NVIDIA A100-SXM4-40GB. There every decode step" in note and "NVIDIA T4" not in note
    assert "(the largest step here: 256 rows)" in note
