"""The floor benchmark's parts: what a step reads, how fast memory reads, what steps cost."""

import math

import pytest
import torch

from conftest import tiny_llama
from lab import floor
from lab.floor import (
    compiled_over_eager,
    linear_flops,
    matmul_peak,
    product_seconds,
    read_bandwidth,
    step_seconds,
    streamed_product_seconds,
    weight_bytes,
)
from rag_spec.cli import main


def nbytes(tensor) -> int:
    return tensor.numel() * tensor.element_size()


def test_a_step_reads_every_weight_but_an_untied_embedding():
    model = tiny_llama()
    every = sum(nbytes(p) for p in model.parameters())
    assert weight_bytes(model) == every - nbytes(model.model.embed_tokens.weight)
    tied = tiny_llama()
    tied.lm_head.weight = tied.model.embed_tokens.weight  # the head reads the whole matrix
    assert weight_bytes(tied) == sum(nbytes(p) for p in tied.parameters())
    assert weight_bytes(tied) < every


def test_read_bandwidth_is_bytes_per_second():
    # any machine this runs on reads a 64 MiB buffer at between 100 MB/s and 10 TB/s
    assert 1e8 < read_bandwidth(gib=1 / 16, repeats=2) < 1e13


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_product_time_times_products_of_the_rows_asked_for(dtype, monkeypatch):
    """A timing charged by rows: what is timed is a product of ``rows`` rows in the model's
    dtype for each linear layer's shape, counted once per layer (no wall clock involved)."""
    model = tiny_llama(hidden=64).to(dtype)
    seen = []

    def charged(x, weight, repeats):
        seen.append((x.shape[0], x.dtype, tuple(weight.shape)))
        return x.shape[0] * 1e-6

    monkeypatch.setattr(floor, "_best_product_seconds", charged)
    one, many = product_seconds(model, 1, repeats=2), product_seconds(model, 512, repeats=2)
    assert {(rows, d) for rows, d, _ in seen} == {(1, dtype), (512, dtype)}
    shapes = {tuple(m.weight.shape) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    assert {shape for _, _, shape in seen} == shapes
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert one == pytest.approx(linears * 1e-6) and many == pytest.approx(512 * one)


def test_product_time_counts_every_linear_layer_once(monkeypatch):
    monkeypatch.setattr(floor, "_seconds", lambda call, device=None: 1.0)
    model = tiny_llama(layers=3)
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert linears == 3 * 7 + 1  # q, k, v, o, gate, up, down per layer; the LM head
    assert product_seconds(model, 17) == linears


def test_a_runner_told_so_keeps_onednn_where_the_streamed_kernel_runs():
    from rag_spec.target.transformers.runner import Runner, RunnerSettings

    model = tiny_llama()
    default, onednn = Runner.of(model), Runner.of(model, RunnerSettings(streamed_linear=False))
    assert default.stacks and not any(stack.streamed for stack in onednn.stacks)
    assert all(stack.streamed == floor.streamed_available(torch.float32)
               for stack in default.stacks)


def test_streamed_products_run_the_models_own_layers_in_order(monkeypatch):
    import rag_spec_kernels

    model = tiny_llama(layers=2)
    linears = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    seen, stock = [], torch.nn.functional.linear

    def recorded(x, weight):
        seen.append((x.shape[0], weight.data_ptr()))
        return stock(x, weight)

    monkeypatch.setattr(rag_spec_kernels, "onednn_available", lambda model: False)
    monkeypatch.setattr(torch.nn.functional, "linear", recorded)
    timed = iter([3.0, 1.0, 2.0])  # an injected clock: each timed pass's seconds

    def clock(call, device=None):
        call()
        return next(timed)

    monkeypatch.setattr(floor, "_seconds", clock)
    assert streamed_product_seconds(model, 17, repeats=3) == 2.0  # the median
    # one untimed pass, then three timed ones, each through every layer once, in order
    assert seen == 4 * [(17, w.data_ptr()) for w in linears]


def test_a_trees_arithmetic_counts_two_operations_per_weight_and_row():
    model = tiny_llama(layers=3, hidden=32)
    weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert linear_flops(model, 17) == 2 * 17 * weights == 17 * linear_flops(model, 1)
    # any machine this runs on multiplies at between 100 MFLOP/s and 10 PFLOP/s
    assert 1e8 < matmul_peak(torch.float32, size=256, repeats=2) < 1e16


def test_no_tree_step_beats_its_products_at_the_peak():
    # a 10 ms plain step of which 4 ms are products; a tree's products take 9 ms at the peak
    assert floor._bound(0.010, 0.004, 0.009, 0.003) == 1.5
    assert floor._bound(0.010, 0.004, 0.001, 0.003) == 0.9  # never below the weight read


def test_step_costs_cover_the_peer_and_our_widths_and_leave_the_model_alone():
    model = tiny_llama()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    costs = step_seconds(model, list(range(3, 40)), widths=(1, 5), repeats=3)
    onednn = {"rag_spec_onednn_1", "rag_spec_onednn_5"} if floor.streamed_available(
        torch.float32) else set()  # oneDNN's kernels beside the streamed ones, where they run
    assert set(costs) == {"hf_1", "rag_spec_1", "rag_spec_5", "rag_spec_exact_1",
                          "rag_spec_exact_5"} | onednn
    assert all(math.isfinite(cost) and cost > 0 for cost in costs.values())  # no time bound
    assert all((model.state_dict()[k] == v).all() for k, v in state.items())


@pytest.mark.slow
def test_the_compiled_step_is_timed_beside_ours_and_leaves_the_model_alone():
    model = tiny_llama()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    config = model.config.to_dict()
    report = compiled_over_eager(model, list(range(3, 40)), widths=(4,), rounds=2)
    assert report["first_pass_s"][4] > 0  # compiled once, in the first round
    assert all(0 < report[key][4] < 10_000 for key in ("compiled_ms", "eager_ms"))
    assert report["compiled_over_eager"][4] > 0
    assert report["max_logit_error"][4] < 1e-4 and report["same_argmax"][4]
    assert all((model.state_dict()[k] == v).all() for k, v in state.items())
    assert model.config.to_dict() == config


def test_unknown_dtypes_are_refused_and_the_lab_left_the_cli(capsys):
    with pytest.raises(SystemExit) as exit_info:
        floor.main(["--dtype", "int8"])
    assert exit_info.value.code == 2
    assert "expected float32, bfloat16 or float16" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a lab bench, not one a user runs on their model
        main(["bench", "floor"])
    assert "invalid choice: 'floor'" in capsys.readouterr().err


def test_the_plot_takes_dtypes_timed_on_different_systems(tmp_path):
    # the streamed kernel is float32's only, so bfloat16 has no oneDNN variant to show
    report = {"model": "tiny", "read_bandwidth_gb_s": 50.0, "machine": {"cpus": 2}, "dtypes": {
        "float32": {"floor_ms": 10.0, "over_floor": {"rag_spec_1": 2.0, "rag_spec_onednn_1": 2.2}},
        "bfloat16": {"floor_ms": 5.0, "over_floor": {"rag_spec_1": 3.0}}}}
    floor._plot(report, tmp_path / "floor.png")
    assert (tmp_path / "floor.png").stat().st_size > 0


def test_longctx_step_costs_time_both_attentions_and_leave_the_prefill_as_it_was(monkeypatch):
    from rag_spec.bench import longctx
    from rag_spec.target.transformers import prefill as prefill_module

    lengths = []
    prefill = prefill_module.prefill

    def watched(*args, **kwargs):
        cache = prefill(*args, **kwargs)
        discard = cache.discard_round

        def dropped():
            discard()
            lengths.append(cache.length)

        cache.discard_round = dropped
        return cache

    monkeypatch.setattr(prefill_module, "prefill", watched)
    costs = longctx.step_ms(tiny_llama(hidden=64), [[5, 6, 7, 8, 9], [5, 6, 7]], widths=(1, 4),
                            repeats=2)
    assert set(costs) == {"ours", "sdpa"}
    assert all(set(c) == {1, 4} and min(c.values()) > 0 for c in costs.values())
    assert len(lengths) == 3 * 2 * 2 and len(set(lengths)) == 1  # every pass on the prompts


def test_the_gpu_projection_divides_tokens_per_pass_by_the_tree_steps_measured_cost(tmp_path):
    import json

    from rag_spec.bench.report import gpu_projection

    report = tmp_path / "gpu.json"
    report.write_text(json.dumps({"step_ms": {"hf_1": 70.0, "rag_spec_1": 40.0,
                                              "rag_spec_8": 44.0, "rag_spec_16": 50.0,
                                              "rag_spec_exact_16": 90.0}}))
    projection = gpu_projection(3.0, 13, report)  # a 13-token step: the 16-token one's cost
    assert projection["width"] == 16 and projection["step_cost"] == 1.25
    assert projection["speedup_vs_no_drafts"] == 2.4
    assert gpu_projection(3.0, 5, report)["step_cost"] == 1.1
    report.write_text(json.dumps({"step_ms": {"rag_spec_1": 40.0, "rag_spec_16": 30.0}}))
    assert gpu_projection(3.0, 13, report)["speedup_vs_no_drafts"] == 3.0  # never below plain
    assert gpu_projection(3.0, 13, tmp_path / "none.json") is None


def test_tokens_per_pass_are_stated_as_a_mean_a_median_and_pooled():
    from rag_spec.bench.report import Run, pass_statistics, runs_pass_statistics
    from rag_spec.engine.batch import DecodeStats

    short = DecodeStats(steps=2, accepted_per_step=[3, 1])  # 6 tokens in 2 passes: 3.0
    long = DecodeStats(steps=8, accepted_per_step=[0] * 8)  # 8 tokens in 8 passes: 1.0
    middle = DecodeStats(steps=4, accepted_per_step=[1, 1, 1, 1])  # 2.0
    assert pass_statistics([short, long, middle]) == {
        "tokens_per_step": 2.0, "tokens_per_step_median": 2.0,
        "tokens_per_step_pooled": round(22 / 14, 3)}  # the long answer weighs most
    assert pass_statistics([short, long]) == {
        "tokens_per_step": 2.0, "tokens_per_step_median": 2.0, "tokens_per_step_pooled": 1.4}
    assert pass_statistics([]) == {}
    runs = [Run(0.0, [], {"stats": [short, long]}), Run(0.0, []), Run(0.0, [], {"stats": [middle]})]
    assert runs_pass_statistics(runs) == pass_statistics([short, long, middle])  # peers add none
