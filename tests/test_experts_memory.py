"""benchmarks/experts_memory.py at its tiny probe shapes: the storage tracker's bookkeeping (a storage counted once
however many views it has, every free seen, the peak the sum of what was live then), what it finds in the package's
step (the pre-activations the forward saves, the gradients live at the end), the formulas fitted across the probes,
and the command line's JSON. The peer (transformers' grouped_mm experts) runs where transformers imports.
"""

import json

import pytest
import torch
from helpers import DEVICE

import experts_memory as em

DTYPE = torch.bfloat16  # the tool's default: byte counts as on the GPU runs it predicts


def _check_accounting(record: em.StepRecord):
    """The invariants every measured step keeps (see each line)."""
    buffers = record.buffers
    live_at_peak = [buffers[i] for i in record.peak_live]
    assert record.peak_bytes == sum(b.nbytes for b in live_at_peak)  # the peak is what was live then
    assert all(b.nbytes <= record.peak_bytes for b in live_at_peak)
    assert all(b.born < b.freed for b in buffers if b.freed is not None)
    assert sum(kind == "alloc" for kind, _ in record.events) == len(buffers)  # one allocation event per buffer
    # freeing seen: after the step only out and the gradients are live, every other buffer was freed in it
    assert record.end_live == record.outputs
    assert all((b.freed is None) == (b.index in record.outputs) for b in buffers)
    live_at_end = sum(b.nbytes for b in buffers) - sum(b.nbytes for b in buffers if b.freed is not None)
    assert live_at_end == sum(buffers[i].nbytes for i in record.outputs)


def test_tracker_counts_each_storage_once_and_sees_it_freed():
    """A plain torch step: views share their storage (one buffer), temporaries are freed, the inputs are not
    counted, and what autograd saves is marked."""
    x = torch.randn(8, 16, requires_grad=True)
    w = torch.randn(16, 32, requires_grad=True)
    grad_out = torch.randn(8, 32)

    def forward():
        h = x @ w  # [8, 32] fp32, freed at the end of the forward (relu saves its output, not its input)
        pairs = h.view(8, 2, 16).transpose(1, 2)  # views of h: no new storage
        return (pairs.relu() * 2.0).reshape(8, 32)  # relu's output (saved), the product, the reshape's copy

    record = em.measure_step(forward, dict(x=x, w=w), {}, grad_out, em.Sizes(8, 1, 1, 16, 32))
    _check_accounting(record)
    forward_buffers = [b for b in record.buffers if b.phase == "forward"]
    assert [b.op for b in forward_buffers[:1]] == ["aten.mm.default"] and forward_buffers[0].nbytes == 8 * 32 * 4
    assert not any(b.op.startswith(("aten.view", "aten.transpose")) for b in record.buffers)
    assert len(record.outputs) == 3 and record.saved_inputs == ("w", "x")  # out, dx, dw; mm saved both inputs
    assert record.peak_bytes >= 3 * 8 * 32 * 4  # h, relu's output and the product live together in the forward


@pytest.fixture(scope="module")
def package_records():
    """The package's step at every probe, Mixtral's layout (every input trained)."""
    return [em.measure("moe_dispatch", em.LAYOUTS["mixtral"], s, DTYPE, DEVICE) for s in em.PROBES]


def test_package_forward_saves_the_preactivations(package_records):
    """The forward's saved pre-activations: one [T*top_k, 2F] buffer the operator allocates, saved for the
    backward and freed in it; the inputs autograd keeps cost nothing; out and the four gradients stay."""
    for record in package_records:
        _check_accounting(record)
        s = record.sizes
        saved = [b for b in record.buffers if b.saved and b.phase == "forward"]
        preact = [b for b in saved if b.shape == (s.T * s.top_k, 2 * s.F)]
        assert len(preact) == 1, [(b.shape, b.allocated_by) for b in saved]
        assert preact[0].dtype == "bfloat16" and preact[0].allocated_by.startswith("moe_dispatch/experts/")
        assert record.forward_end <= preact[0].freed  # freed in the backward
        assert {"x", "w_gate_up", "w_down", "topk_weights"} <= set(record.saved_inputs)
        assert len(record.outputs) == 5


def test_formulas_name_every_large_buffer_and_replay_the_probes(package_records):
    """Fitted across the probes, the formulas give back each probe's measured peak, and scale the saved
    pre-activations and the weight gradients to real sizes."""
    fitted = em.fit(package_records)
    for record in package_records:
        assert em.replay_peak(record, fitted, record.sizes).nbytes == record.peak_bytes
    formulas = {f.formula for f in fitted if f.buffer.nbytes >= 512}
    assert {"[T*top_k, 2F]", "[E, 2F, H]", "[E, H, F]", "[T, H]"} <= formulas, formulas
    assert not any("?" in f.formula for f in fitted)
    s = em.model_sizes("mixtral-8x7b", 4096)
    preact = next(f for f in fitted if f.buffer.saved and f.formula == "[T*top_k, 2F]")
    assert preact.nbytes(s) == s.T * s.top_k * 2 * s.F * 2
    peak = em.replay_peak(package_records[0], fitted, s)
    weight_grads = (3 * s.E * s.F * s.H) * 2
    assert peak.nbytes > weight_grads + preact.nbytes(s) and preact.buffer.index in peak.live


def test_peer_saves_its_gate_up_output():
    """transformers' grouped_mm experts on the same tensors: its saved [T*top_k, 2F] gate/up output and gathered
    rows of x, the same accounting."""
    pytest.importorskip("transformers")
    layout = em.LAYOUTS["mixtral"]
    implementation, why_not = em.peer_implementation(layout, DTYPE, DEVICE)
    s = em.PROBES[0]
    record = em.measure("grouped_mm", layout, s, DTYPE, DEVICE, peer_impl=implementation)
    _check_accounting(record)
    saved = {b.shape for b in record.buffers if b.saved and b.phase == "forward"}
    assert {(s.T * s.top_k, 2 * s.F), (s.T * s.top_k, s.H)} <= saved, saved
    if why_not is None:
        assert "aten._grouped_mm.default" in record.ops_seen


def test_command_line_json(tmp_path, capsys):
    """The GPT-OSS stored layout with frozen experts (a short run): the table and the JSON's cells."""
    path = tmp_path / "memory.json"
    em.main(["--layouts", "gpt-oss", "--models", "gpt-oss-120b", "--tokens", "4096", "--train", "activations",
             "--json", str(path)])
    printed = capsys.readouterr().out
    assert "predicted peak above the inputs" in printed and "gpt-oss-120b T=4096" in printed
    results = json.loads(path.read_text())
    layout = results["layouts"]["gpt-oss"]
    assert set(layout["implementations"]) == set(em.IMPLS)
    for impl in em.IMPLS:
        result = layout["implementations"][impl]
        cell = result["cells"]["gpt-oss-120b T=4096"]
        assert cell["peak"] >= max(b["cells"]["gpt-oss-120b T=4096"]["bytes"] for b in result["buffers"])
        assert all(p["measured_peak"] == p["replayed_peak"] for p in result["probes"])
    package = layout["implementations"]["moe_dispatch"]  # frozen experts: no weight gradient allocated
    assert not {b["formula"] for b in package["buffers"]} & {"[E, H, 2F]", "[E, F, H]"}


def test_package_backward_fills_no_zero_gradient_for_its_other_outputs(package_records):
    """The operator's outputs besides `out` (the pre-activations [T*top_k, 2F], the dispatch) get no gradient, and
    autograd fills no zeros for them (`set_materialize_grads(False)`): without it, a zero [T*top_k, 2F] buffer is live
    at the backward's peak."""
    for record in package_records:
        filled = [b for b in record.buffers if b.phase == "backward" and b.allocated_by.startswith("autograd")
                  and "zeros" in b.op]
        assert not filled, [(b.shape, b.dtype, b.op) for b in filled]


def test_package_backward_frees_the_activated_rows_before_the_gate_up_gradient(package_records):
    """The backward writes dW_down (the last reader of the activated rows [T*top_k, F]) before it allocates the
    gate/up weight's gradient [E, 2F, H], and frees the rows in between: the largest gradient never sits beside them."""
    for record in package_records:
        s = record.sizes
        backward = [b for b in record.buffers if b.phase == "backward"]
        act = [b for b in backward if b.shape == (s.T * s.top_k, s.F)]
        grad_gate_up = [b for b in backward if b.shape == (s.E, 2 * s.F, s.H)]
        assert len(act) == 1 and len(grad_gate_up) == 1, [(b.shape, b.op) for b in backward]
        assert act[0].freed is not None and act[0].freed < grad_gate_up[0].born, (act[0], grad_gate_up[0])
