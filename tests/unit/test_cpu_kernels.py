"""The oneDNN linear kernel swap (specd/cpu_kernels.py) on small models."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from specd import cpu_kernels
from specd.cpu_kernels import OneDnnLinear, use_linear_kernel

pytestmark = pytest.mark.skipif(not cpu_kernels.onednn_linear_works(), reason="this torch build has no oneDNN linear op")


class TiedLM(nn.Module):
    """An embedding, two linear layers and an LM head tied to the embedding, like the bundled target."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(300, 48)
        self.up = nn.Linear(48, 96)
        self.down = nn.Linear(96, 48, bias=False)
        self.head = nn.Linear(48, 300, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.down(torch.relu(self.up(self.embed(ids)))))


def test_onednn_swaps_every_linear_keeps_tied_weights_and_agrees_with_torch():
    model = TiedLM()
    ids = torch.randint(0, 300, (3, 7))
    with torch.inference_mode():
        want = model(ids)
    assert use_linear_kernel(model, "onednn") == 3
    assert all(type(m) is OneDnnLinear for m in (model.up, model.down, model.head))
    assert model.head.weight is model.embed.weight  # tied: the dense weights stay shared
    assert all(m.packed_weight is not None and m.packed_weight.is_mkldnn for m in (model.up, model.down, model.head))
    for rows in (ids[:1, :1], ids[:1], ids):  # one token, one sequence, a batch
        with torch.inference_mode():
            got = model(rows)
            torch.testing.assert_close(got, want[: rows.shape[0], : rows.shape[1]], rtol=1e-5, atol=1e-5)


def test_packed_weights_serve_every_row_count_a_server_runs():
    """Packed for PACK_ROWS rows, the weights give the dense product for one row (plain decoding),
    a few (a block), a batch and a prompt's prefill of hundreds."""
    model = TiedLM()
    ids = torch.randint(0, 300, (1, 300))
    with torch.inference_mode():
        want = model(ids)
    use_linear_kernel(model, "onednn")
    for n in (1, 2, 5, 16, 17, 64, 300):
        with torch.inference_mode():
            torch.testing.assert_close(model(ids[:, :n]), want[:, :n], rtol=1e-5, atol=1e-5)


def test_aten_restores_torchs_kernel():
    model = TiedLM()
    use_linear_kernel(model, "onednn")
    assert use_linear_kernel(model, "aten") == 0
    assert all(type(m) is nn.Linear for m in (model.up, model.down, model.head))
    assert all(getattr(m, "packed_weight", None) is None for m in (model.up, model.down, model.head))


def test_a_model_that_is_not_float32_keeps_torchs_kernel():
    model = TiedLM().to(torch.bfloat16)
    assert use_linear_kernel(model, "onednn") == 0
    assert type(model.up) is nn.Linear


def test_a_failing_probe_leaves_the_model_unchanged(monkeypatch):
    def broken(*args):
        raise RuntimeError("no oneDNN here")

    monkeypatch.setattr(cpu_kernels, "_onednn_linear", broken)
    model = TiedLM()
    assert use_linear_kernel(model, "onednn") == 0
    assert type(model.head) is nn.Linear


def test_an_unknown_kernel_is_refused_by_name():
    with pytest.raises(ValueError, match="'blas'.*onednn, aten"):
        use_linear_kernel(TiedLM(), "blas")


def test_runs_onednn_reads_the_output_embeddings():
    class WithHead(TiedLM):
        def get_output_embeddings(self) -> nn.Module:
            return self.head

    model = WithHead()
    assert not cpu_kernels.runs_onednn(model)
    use_linear_kernel(model, "onednn")
    assert cpu_kernels.runs_onednn(model)
    assert not cpu_kernels.runs_onednn(nn.Linear(2, 2))  # no output embeddings at all


def pass_cost(torch_ms: dict[int, float], onednn_ms: dict[int, float]):
    """A fake pass timer: a pass of r rows costs torch_ms[r] where the layers run r rows on
    torch's kernel, else onednn_ms[r]; it records the (rows, kernel) of every pass."""
    timed: list[tuple[int, str]] = []

    def seconds(model: nn.Module, rows: int) -> float:
        on_torch = rows <= model.up.torch_rows
        assert on_torch == (rows <= model.down.torch_rows) == (rows <= model.head.torch_rows)
        timed.append((rows, "torch" if on_torch else "onednn"))
        return (torch_ms if on_torch else onednn_ms)[rows]

    seconds.timed = timed  # type: ignore[attr-defined]
    return seconds


def test_tuning_puts_products_of_few_rows_on_the_faster_kernel_and_leaves_wider_ones_on_onednn(monkeypatch):
    model = TiedLM()
    use_linear_kernel(model, "onednn")
    reference = TiedLM()  # torch's kernel throughout
    calls = []
    real = cpu_kernels._onednn_linear
    monkeypatch.setattr(cpu_kernels, "_onednn_linear", lambda *a: calls.append(a[0].shape) or real(*a))
    # torch's kernel faster at 1 and 2 rows, oneDNN's from 3 on
    timer = pass_cost({1: 1.0, 2: 1.1, 3: 2.0}, {1: 1.5, 2: 1.6, 3: 1.7})
    assert cpu_kernels.tune_few_rows(model, rounds=2, pass_seconds=timer) == 2
    assert {rows for rows, _ in timer.timed} == {1, 2, 3}  # stopped at the first count oneDNN won
    ids = torch.randint(0, 300, (1, 5))
    calls.clear()
    with torch.inference_mode():
        assert torch.equal(model(ids[:, :2]), reference(ids[:, :2]))  # two rows: torch's very product
        assert not calls
        torch.testing.assert_close(model(ids), reference(ids), rtol=1e-5, atol=1e-5)
    assert len(calls) == 3  # five rows: every layer on oneDNN
    assert cpu_kernels.tune_few_rows(model, rounds=2, pass_seconds=pass_cost({1: 2.0}, {1: 1.0})) == 0
    calls.clear()
    with torch.inference_mode():
        model(ids[:, :1])
    assert len(calls) == 3
    use_linear_kernel(model, "onednn")  # swapping kernels again voids the tuning
    assert model.up.torch_rows == 0


def test_tuning_stops_at_the_widest_count_it_times():
    model = TiedLM()
    use_linear_kernel(model, "onednn")
    timer = pass_cost(dict.fromkeys(range(1, 5), 1.0), dict.fromkeys(range(1, 5), 2.0))
    assert cpu_kernels.tune_few_rows(model, max_rows=4, rounds=1, pass_seconds=timer) == 4
    assert max(rows for rows, _ in timer.timed) == 4


def test_a_row_count_timed_while_the_machine_was_busy_is_timed_again():
    model = TiedLM()
    use_linear_kernel(model, "onednn")
    busy_spells = {2: 2}  # the first two timings of two-row passes find the machine busy
    timed: list[int] = []

    def seconds(model: nn.Module, rows: int) -> float:
        on_torch = rows <= model.up.torch_rows
        timed.append(rows)
        calls_at_rows = timed.count(rows)
        warmups = 1
        if rows in busy_spells and warmups < calls_at_rows <= warmups + 2 * busy_spells[rows]:
            return 10.0 if on_torch else 9.0  # both kernels slow, oneDNN's less so
        return {1: (1.0, 1.5), 2: (1.1, 1.6), 3: (2.0, 1.7)}[rows][0 if on_torch else 1]

    waits: list[float] = []
    assert cpu_kernels.tune_few_rows(model, rounds=1, pass_seconds=seconds, sleep=waits.append) == 2
    assert waits == [cpu_kernels.BUSY_WAIT_S] * 2


def test_torch_keeps_only_the_row_counts_up_to_its_first_loss():
    assert cpu_kernels.torch_rows_from([True, True, False, True]) == 2
    assert cpu_kernels.torch_rows_from([False, True]) == 0
    assert cpu_kernels.torch_rows_from([]) == 0


def test_the_fastest_assignment_is_the_one_with_the_best_pass_each_timed_once_a_round_in_rotation():
    order: list[int] = []
    times = {0: iter([5.0, 1.0, 5.0]), 1: iter([2.0, 2.0, 2.0]), 2: iter([3.0, 3.0, 3.0])}

    def seconds(i: int) -> float:
        order.append(i)
        return next(times[i])

    chosen, best = cpu_kernels.fastest_assignment(seconds, 3, rounds=3)
    assert (chosen, best) == (0, [1.0, 2.0, 3.0])  # a busy spell only adds time: the best pass counts
    assert order == [0, 1, 2, 1, 2, 0, 2, 0, 1]


def test_tuning_a_model_without_onednn_layers_changes_nothing():
    model = TiedLM()
    assert cpu_kernels.tune_few_rows(model) == 0
    assert type(model.up) is nn.Linear
