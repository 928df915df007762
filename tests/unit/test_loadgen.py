"""The load generator's pure parts: arrivals, percentiles, per-request latencies, the summary."""

from __future__ import annotations

import copy
from collections import Counter

import pytest

from coordinator.bench_load import (best_fixed, cell_decode_work, cell_order, cell_requests, cell_window,
                                   held_out_choices, interleaved, target_tally, merge_reports, render, split_requests,
                                   summarize_parts, table_lines, useless_draft_cells)
from coordinator.loadgen import (SLO, RequestRecord, held_window, k_over_time, percentile, poisson_arrivals, step_rate,
                                 summarize, window_tokens)
from coordinator.target_work import CellWork


def test_poisson_arrivals_have_the_asked_rate_and_are_seeded() -> None:
    times = poisson_arrivals(5.0, 200.0, seed=1)
    assert times == sorted(times) and all(0 <= t < 200 for t in times)
    assert len(times) == pytest.approx(1000, rel=0.1)
    assert times == poisson_arrivals(5.0, 200.0, seed=1) != poisson_arrivals(5.0, 200.0, seed=2)
    assert poisson_arrivals(0.0, 10.0) == []


def test_a_rate_that_rises_and_falls_is_followed() -> None:
    rate = step_rate([(0.0, 1.0), (100.0, 10.0), (200.0, 1.0)])
    assert (rate(50), rate(150), rate(250)) == (1.0, 10.0, 1.0)
    times = poisson_arrivals(rate, 300.0, seed=3)
    middle = sum(1 for t in times if 100 <= t < 200)
    edges = len(times) - middle
    assert middle == pytest.approx(1000, rel=0.1) and edges == pytest.approx(200, rel=0.25)


def test_percentile_interpolates() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([0.0, 10.0], 99) == pytest.approx(9.9)


def test_a_held_window_opens_at_the_lead_in_requests_end_and_closes_at_the_last() -> None:
    ends = [2.0, 1.0, 1.001, 3.5, 3.0]  # requests in step end within a few ms, appended out of order
    assert held_window(ends, 2, 9.0) == (1.001, 3.5)
    assert held_window(ends, 0, 9.0) == (0.0, 3.5)  # no lead-in: from the start
    assert held_window([], 2, 9.0) == (0.0, 9.0)  # nothing ended: until now


def _record(sent: float, chunks: list[tuple[float, int]], k_per_step: list[int], drafted: int = 0,
            accepted: int = 0) -> RequestRecord:
    r = RequestRecord("p", "kind", sent)
    r.first_token = chunks[0][0]
    r.chunk_times = [t for t, _ in chunks]
    r.chunk_tokens = [n for _, n in chunks]
    r.done = chunks[-1][0]
    r.tokens = sum(n for _, n in chunks)
    r.k_per_step, r.num_draft_tokens, r.num_accepted_tokens = k_per_step, drafted, accepted
    return r


def test_inter_token_latency_spreads_a_chunk_over_its_tokens() -> None:
    r = _record(0.0, [(0.5, 1), (0.9, 4)], [4])
    assert r.ttft == 0.5 and r.latency == 0.9
    assert r.inter_token_latencies() == pytest.approx([0.1] * 4)


def test_summary_counts_goodput_errors_and_acceptance() -> None:
    fast = _record(0.0, [(0.2, 1), (0.3, 1), (0.4, 2)], [0, 2], drafted=2, accepted=1)
    slow = _record(0.0, [(3.0, 1), (3.1, 1)], [0])  # misses the 2 s TTFT bound
    failed = RequestRecord("p", "kind", 0.0, error="UNAVAILABLE: gone")
    s = summarize([fast, slow, failed], wall_s=4.0, slo=SLO(ttft_s=2.0, itl_p99_s=0.5))
    assert (s["requests"], s["completed"], s["errors"]) == (3, 2, 1)
    assert s["tokens_per_s"] == pytest.approx(6 / 4) and s["goodput_tokens_per_s"] == pytest.approx(4 / 4)
    assert s["goodput_requests"] == 1 and s["acceptance_rate"] == 0.5
    assert s["mean_k"] == pytest.approx(2 / 3, abs=1e-3)  # rounded to 3 places


def test_k_over_time_bins_steps_between_first_token_and_end() -> None:
    early = _record(0.0, [(0.0, 1), (2.0, 1)], [4, 4])  # steps at 0.5 s and 1.5 s
    late = _record(0.0, [(4.0, 1), (6.0, 1)], [0, 2])  # steps at 4.5 s and 5.5 s
    assert k_over_time([early, late], bin_s=2.0) == [(0.0, 4.0, 2), (4.0, 1.0, 2)]


def test_best_fixed_picks_the_fastest_fixed_k() -> None:
    assert best_fixed({"off": 30.0, "k2": 10.0, "k4": 20.0, "k8": 15.0, "auto": 50.0}, [2, 4, 8]) == ("k4", 20.0)


def test_window_counts_the_tokens_that_arrived_in_it_cut_requests_included() -> None:
    done = _record(0.0, [(1.0, 1), (2.0, 3), (3.0, 2)], [0, 2, 1])
    cut = RequestRecord("p", "kind", 0.0, first_token=1.5, chunk_times=[1.5, 2.5], chunk_tokens=[1, 4], cut=True)
    assert window_tokens([done, cut], 1.0, 2.5) == 3 + 1 + 4  # (start, end]: the chunk at 1.0 is before it
    s = summarize([done, cut], wall_s=3.0, window=(1.0, 2.5))
    assert s["tokens_per_s"] == pytest.approx(8 / 1.5, abs=0.01)  # rounded to 2 places
    assert (s["completed"], s["cut"], s["errors"]) == (1, 1, 0)
    assert s["ttft_ms_p50"] == pytest.approx(1250.0)  # both first tokens count
    assert s["latency_ms_p50"] == pytest.approx(3000.0)  # only the finished request has a latency
    assert summarize([done, cut], wall_s=3.0)["tokens_per_s"] == pytest.approx(6 / 3)  # no window: finished ones


def test_a_request_that_ended_without_a_result_and_was_not_cut_is_an_error() -> None:
    silent = RequestRecord("p", "kind", 0.0, first_token=0.1, chunk_times=[0.1], chunk_tokens=[1])
    assert summarize([silent], wall_s=1.0)["errors"] == 1


def test_fixed_work_cells_scale_their_requests_with_concurrency_at_least_one_per_client() -> None:
    assert [cell_requests(48, c, 16) for c in (2, 4, 8, 16)] == [6, 12, 24, 48]
    assert cell_requests(8, 4, 16) == 4  # never fewer requests than clients
    assert cell_requests(0, 16, 16) == 0  # 0: timed windows


def _slot_sums(runs) -> dict[str, int]:
    """Per configuration, the sum of its slots: equal for all when a machine that slows by one
    unit per run costs every configuration the same."""
    slots: dict[str, int] = {}
    for t, ((name, _), _) in enumerate(runs):
        slots[name] = slots.get(name, 0) + t
    return slots


def test_fixed_work_cells_run_in_mirrored_halves_so_a_linear_drift_costs_every_configuration_alike() -> None:
    assert split_requests(96, 16) == [48, 48]
    assert split_requests(12, 2) == [6, 6]
    assert split_requests(17, 16) == [17]  # two halves would leave clients idle: one part
    order = [("off", "0"), ("k2", "2"), ("auto", "auto")]
    runs = interleaved(order, [24, 25])
    assert [c[0] for c, _ in runs] == ["off", "k2", "auto", "auto", "k2", "off"]
    assert [n for _, n in runs] == [24, 24, 24, 25, 25, 25]
    assert len(set(_slot_sums(runs).values())) == 1, _slot_sums(runs)


def test_a_part_holds_at_least_three_waves_of_requests_so_its_window_edges_stay_a_small_share() -> None:
    assert split_requests(48, 16) == [48]  # two halves would each hold 1.5 waves: one part
    assert split_requests(95, 16) == [95]
    assert split_requests(144, 16, 4) == [48, 48, 48]  # as many parts as hold three waves each
    assert sum(split_requests(150, 16, 4)) == 150
    assert split_requests(6, 2) == [6]


def test_more_parts_rotate_a_latin_square_where_no_configuration_runs_twice_in_a_row() -> None:
    assert split_requests(192, 16, 4) == [48, 48, 48, 48]
    order = [("off", "0"), ("k2", "2"), ("k4", "4"), ("auto", "auto")]
    runs = interleaved(order, [16, 16, 16, 16])
    names = [c[0] for c, _ in runs]
    assert names[:8] == ["off", "k2", "k4", "auto", "k2", "k4", "auto", "off"]
    assert all(a != b for a, b in zip(names, names[1:]))
    for slot in range(4):  # every configuration once in every slot of a round
        assert sorted(names[r * 4 + slot] for r in range(4)) == sorted(n for n, _ in order)
    assert len(set(_slot_sums(runs).values())) == 1, _slot_sums(runs)
    assert all(n == 16 for _, n in runs)


def test_cell_windows_grow_with_concurrency_from_five_seconds() -> None:
    assert [cell_window(12.0, c, 16) for c in (2, 4, 8, 16)] == [5.0, 5.0, 6.0, 12.0]
    assert cell_window(3.0, 16, 16) == 5.0


def test_a_cut_request_counts_its_streamed_steps_and_k_over_time_uses_chunk_times() -> None:
    done = _record(0.0, [(0.5, 1), (1.0, 3), (4.5, 1)], [2, 0])
    done.chunk_k = [None, 2, 0]
    cut = RequestRecord("p", "kind", 0.0, first_token=0.5, chunk_times=[0.5, 1.5, 2.5], chunk_tokens=[1, 2, 1],
                        chunk_k=[None, 4, 4], cut=True)
    s = summarize([done, cut], wall_s=5.0, window=(0.5, 5.0))
    assert s["mean_k"] == pytest.approx((2 + 0 + 4 + 4) / 4)
    # at their chunks' times, not spread over the request
    assert k_over_time([done, cut], bin_s=2.0) == [(0.0, 3.0, 2), (2.0, 4.0, 1), (4.0, 0.0, 1)]


def test_cell_order_starts_a_square_from_the_first_row() -> None:
    configs = [(n, n) for n in ("off", "k2", "k4", "k8", "auto")]
    orders = [[n for n, _ in cell_order(configs, run)] for run in range(10)]
    assert orders[0] == ["off", "k2", "auto", "k4", "k8"]  # 0, 1, n-1, 2, n-2
    assert orders[5] == orders[0][::-1]  # an odd square's second half mirrors its first
    assert sorted(o[0] for o in orders) == sorted(2 * [n for n, _ in configs])


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6])
def test_cell_order_over_a_square_balances_slots_neighbours_and_precedence(n: int) -> None:
    """Over a whole Williams square every configuration runs once in each slot (per copy of the
    square), right after each other one equally often, and before each other one in half the
    runs: the old rotation ran off before auto in every run with four configurations."""
    configs = [(str(i), str(i)) for i in range(n)]
    rows = n if n % 2 == 0 else 2 * n
    orders = [[int(name) for name, _ in cell_order(configs, run)] for run in range(rows)]
    assert all(sorted(o) == list(range(n)) for o in orders)
    for slot in range(n):
        assert Counter(o[slot] for o in orders) == {i: rows // n for i in range(n)}
    neighbours = Counter((o[i], o[i + 1]) for o in orders for i in range(n - 1))
    assert len(neighbours) == n * (n - 1) and len(set(neighbours.values())) == 1
    before = Counter((a, b) for o in orders for i, a in enumerate(o) for b in o[i + 1:])
    assert set(before.values()) == {rows // 2}
    assert cell_order(configs, rows) == cell_order(configs, 0)  # the square repeats


def test_cell_order_runs_auto_before_off_in_half_the_runs_with_two_fixed_depths() -> None:
    configs = [(n, n) for n in ("off", "k2", "k4", "auto")]
    orders = [[n for n, _ in cell_order(configs, run)] for run in range(4)]
    assert sum(o.index("auto") < o.index("off") for o in orders) == 2
    assert sorted(o[0] for o in orders) == sorted(n for n, _ in configs)


def test_a_cells_parts_add_their_windows_tokens_and_times() -> None:
    """Held parts count their windows' tokens, cut requests' included; a concurrency-1 part's
    window is its whole wall time."""
    done = _record(0.0, [(1.0, 2), (2.0, 2)], [1, 1])
    cut = RequestRecord("p", "kind", 0.0, first_token=1.5, chunk_times=[1.5, 2.5], chunk_tokens=[3, 5], cut=True)
    held = summarize_parts([([done, cut], (0.0, 2.0)), ([_record(0.0, [(0.5, 4)], [1])], (0.0, 2.0))])
    assert held["tokens_per_s"] == pytest.approx((2 + 2 + 3 + 4) / 4.0)
    assert (held["completed"], held["cut"]) == (2, 1)
    walls = summarize_parts([([done], (0.0, 4.0)), ([done], (0.0, 4.0))])
    assert walls["tokens_per_s"] == pytest.approx(8 / 8.0)


class _CountingGenerator:
    """A load generator at concurrency 1 whose passes take the time their depth asks: off 1 s a
    request, k = 4 2 s, auto 1.25 s; every request streams 10 tokens. It records the order."""

    SECONDS = {"0": 1.0, "4": 2.0, "auto": 1.25}

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def closed_loop(self, concurrency: int, requests: int, spec) -> tuple[list[RequestRecord], float]:
        assert concurrency == 1 and spec.method == ("none" if spec.depth == "0" else "draft_model")
        self.calls.append((spec.depth, requests))
        seconds = self.SECONDS[spec.depth]
        return [_record(0.0, [(seconds, 10)], [0]) for _ in range(requests)], seconds * requests


def test_useless_draft_cells_interleave_their_passes_and_add_them_up() -> None:
    gen = _CountingGenerator()
    cells = useless_draft_cells(gen, requests=2, passes=3, run=0, max_tokens=32)
    assert cells == pytest.approx({"off": 10.0, "k4": 5.0, "auto": 8.0})
    depths = [k for k, _ in gen.calls]
    assert sorted(depths) == sorted(["0", "4", "auto"] * 3) and all(n == 2 for _, n in gen.calls)
    assert all(a != b for a, b in zip(depths, depths[1:])), depths  # no configuration twice in a row
    assert {depths[0], depths[3], depths[6]} == {"0", "4", "auto"}  # each leads one round


def _report_of(off: float, auto: float, useless_auto: float) -> dict:
    """A bench-load report of one kind at concurrency 1 and 16, fixed k = 4 at 20 tok/s."""
    cell = {"off": off, "k4": 20.0, "auto": auto}
    return {"tokens_per_s": {"chat": {"1": dict(cell), "16": dict(cell)}},
            "itl_ms_p50": {"chat": {"1": {n: 40.0 for n in cell}, "16": {n: 80.0 for n in cell}}},
            "auto_mean_k": {"chat": {"1": 1.0, "16": 0.0}},
            "transformers_target_only_tokens_per_s": {"chat": 10.0},
            "useless_draft_c1_tokens_per_s": {"off": 10.0, "auto": useless_auto},
            "ramp": {}, "errors": 0,
            "settings": {"runs": 1, "max_tokens": 32, "method": "ngram", "concurrency": [1, 16], "fixed_k": [4],
                         "pipeline": False, "window_seconds": 12.0, "stagger_seconds": 0.2, "cell_requests": 48,
                         "cell_parts": 2, "c1_passes": 3}}


def test_merged_reports_also_give_each_runs_own_ratios_and_their_median() -> None:
    """The paired figures: each run's auto over the configuration measured in that run, then
    the median; here they differ from the medians' ratios (1.1 at 16 sessions)."""
    reports = [_report_of(10.0, 18.0, 9.0), _report_of(30.0, 22.0, 11.0), _report_of(20.0, 30.0, 13.0)]
    reports[1]["settings"]["first_run"] = 1
    merged = merge_reports(reports)
    paired = merged["paired"]
    assert paired["runs"] == 3
    assert paired["checks"]["chat"]["high_auto_vs_off"] == 1.5  # of 1.8, 0.733 and 1.5
    assert paired["checks"]["chat"]["low_auto_vs_best_fixed"] == 1.1  # of 0.9, 1.1 and 1.5 (k = 4 at 20)
    assert paired["checks"]["chat"]["low_auto_vs_transformers_target_only"] == 2.2
    assert paired["useless_draft_auto_vs_off"] == 1.1
    assert merged["settings"]["first_run"] == [0, 1, 0]
    text = render(merged)
    assert "median over the 3 runs" in text and "| chat | 2.20x | 1.10x | 1.50x | 1.10x |" in text
    assert "median over the" not in render(merge_reports(reports[:1]))  # one run: no paired table


def test_a_report_says_which_held_window_its_cells_used_and_reports_of_both_do_not_merge() -> None:
    """Held cells opened after a lead-in (since 2026-12-05) and from the start (before) measure
    different windows; a report says which, and merging one of each is refused."""
    before, after = _report_of(10.0, 18.0, 9.0), _report_of(10.0, 18.0, 9.0)
    after["settings"]["held_lead_in"] = True
    text = render(merge_reports([after, after]))
    assert "opening wave's last end" in text
    assert "in up to 2 parts" in text and "fewer than 3 requests a client" in text
    after["settings"]["cell_parts"] = 1
    assert "in one part" in render(merge_reports([after, after]))
    assert "opening wave" not in render(merge_reports([before])) and "until then" in render(merge_reports([before]))
    with pytest.raises(ValueError, match="held windows"):
        merge_reports([after, before])


def test_a_table_drops_a_column_whose_header_repeats() -> None:
    assert table_lines(["kind", "c16: x", "c16: x", "c16: y"], [["chat", "1.0x", "1.0x", "2.0x"]]) == [
        "| kind | c16: x | c16: y |", "|---|---|---|", "| chat | 1.0x | 2.0x |"]


def test_a_one_level_report_sets_auto_against_the_best_fixed_k_once() -> None:
    """A bench of concurrency 16 alone: the low and the high targets are the same level."""
    report = _report_of(20.0, 22.0, 10.0)
    for table in ("tokens_per_s", "itl_ms_p50", "auto_mean_k"):
        del report[table]["chat"]["1"]
    report["settings"]["concurrency"] = [16]
    reports = [report, copy.deepcopy(report)]
    reports[1]["settings"]["first_run"] = 1
    text = render(merge_reports(reports))
    header = next(line for line in text.splitlines() if line.startswith("| kind | transformers"))
    assert header.count("c16: auto vs best fixed k") == 1
    assert "| chat | 2.20x | 1.10x | 1.10x |" in text  # the runs' own: vs transformers, vs k4, vs off
    assert "| kind | c16: auto vs held-out best fixed k |" in text


def test_each_runs_fixed_k_is_chosen_on_the_other_runs() -> None:
    assert held_out_choices({"k2": [20.0, 23.0, 17.0], "k4": [21.0, 19.0, 22.0]}) == ["k4", "k4", "k2"]
    assert held_out_choices({"k2": [20.0, 30.0], "k4": [25.0, 21.0]}) == ["k2", "k4"]


def test_auto_is_also_set_against_the_fixed_k_picked_on_the_other_runs() -> None:
    """Fixed k = 2 and 4 trade places from run to run: each run's own best is the high one of
    the two, and auto reads 0.91x it; against the k the other runs pick, 1.05x."""
    reports = []
    for k2, k4 in ((20.0, 21.0), (23.0, 19.0), (17.0, 22.0)):
        report = _report_of(20.0, 20.0, 10.0)
        for cell in report["tokens_per_s"]["chat"].values():
            cell.update(k2=k2, k4=k4, auto=20.0)
        report["itl_ms_p50"]["chat"] = {c: {n: 40.0 for n in ("off", "k2", "k4", "auto")} for c in ("1", "16")}
        report["settings"]["fixed_k"] = [2, 4]
        reports.append(report)
    checks = merge_reports(reports)["paired"]["checks"]["chat"]
    assert checks["high_auto_vs_best_fixed"] == 0.909  # of 0.952, 0.870, 0.909
    assert checks["high_auto_vs_held_out_fixed"] == 1.053  # of 20/21, 20/19, 20/17
    assert checks["high_held_out_fixed"] == checks["low_held_out_fixed"] == ["k4", "k4", "k2"]
    assert "| chat | 1.05x (k4, k4, k2) | 1.05x (k4, k4, k2) |" in render(merge_reports(reports))
    assert "held-out" not in render(merge_reports(reports[:1]))  # one run: nothing to choose on


def test_reports_made_apart_merge_to_their_medians_and_the_checks_are_made_on_those() -> None:
    merged = merge_reports([_report_of(10.0, 18.0, 9.0), _report_of(30.0, 22.0, 11.0), _report_of(20.0, 30.0, 13.0)])
    assert merged["tokens_per_s"]["chat"]["16"] == {"off": 20.0, "k4": 20.0, "auto": 22.0}
    assert merged["checks"]["chat"]["high_auto_vs_off"] == 1.1  # the medians' ratio, not a median of ratios
    assert merged["useless_draft_auto_vs_off"] == 1.1
    assert merged["settings"]["runs"] == 3
    assert "medians of 3 run(s)" in render(merged)
    other = _report_of(10.0, 18.0, 9.0)
    other["settings"]["concurrency"] = [1, 8]
    with pytest.raises(ValueError, match="concurrency"):
        merge_reports([_report_of(10.0, 18.0, 9.0), other])


def test_the_targets_are_tallied_kind_by_kind_with_the_misses_ratios() -> None:
    """0.998x the best fixed k prints 1.00x in the tables and misses "at least the best fixed k":
    the tally says so, to three digits."""
    checks = {
        "chat": {"low_auto_vs_best_fixed": 0.97, "high_auto_vs_off": 1.0, "high_auto_vs_best_fixed": 1.16,
                 "low_auto_vs_transformers_target_only": 1.3},
        "code_edit": {"low_auto_vs_best_fixed": 0.949, "high_auto_vs_off": 0.97, "high_auto_vs_best_fixed": 0.998,
                      "low_auto_vs_transformers_target_only": 1.95},
    }
    assert target_tally(checks, 0.954, "c1", "c16") == [
        "c1: auto >= 0.95x the best fixed k: 1 of 2 kinds (not code_edit 0.949x)",
        "c16: auto >= 0.97x speculation off: 2 of 2 kinds",
        "c16: auto >= the best fixed k: 1 of 2 kinds (not code_edit 0.998x)",
        "c1: code_edit, auto >= 2x transformers' target-only: 1.950x (not met)",
        "useless draft: auto >= 0.95x speculation off: 0.954x",
    ]
    assert target_tally({"chat": checks["chat"]}, None, "c1", "c8")[2] == "c8: auto >= the best fixed k: 1 of 1 kinds"
    assert target_tally(checks, None, "c16", "c16") == [  # 16 sessions alone: no concurrency-1 targets
        "c16: auto >= 0.97x speculation off: 2 of 2 kinds",
        "c16: auto >= the best fixed k: 1 of 2 kinds (not code_edit 0.998x)",
    ]
    assert target_tally(checks, None, "c1", "c1") == [  # concurrency 1 alone: no targets at 16
        "c1: auto >= 0.95x the best fixed k: 1 of 2 kinds (not code_edit 0.949x)",
        "c1: code_edit, auto >= 2x transformers' target-only: 1.950x (not met)",
    ]


def test_the_report_tallies_the_targets_on_the_medians_and_on_each_runs_ratios() -> None:
    reports = [_report_of(10.0, 18.0, 9.0), _report_of(30.0, 22.0, 11.0), _report_of(20.0, 30.0, 13.0)]
    text = render(merge_reports(reports))
    assert "Against the issue's targets, on these ratios:" in text
    assert "- c16: auto >= 0.97x speculation off: 1 of 1 kinds" in text  # 22 / 20
    assert "Against the issue's targets, on each run's own ratios (their medians):" in text
    assert "- c1: auto >= 0.95x the best fixed k: 1 of 1 kinds" in text


def test_a_cells_decode_work_is_its_verify_time_over_every_token_and_its_mean_prefill() -> None:
    parts = [(CellWork(passes=10, rows=16.0, verify_ms=600.0, prefills=20, prefill_ms=5000.0), 150),
             (CellWork(passes=8, rows=15.0, verify_ms=450.0, prefills=20, prefill_ms=5400.0), 150)]
    assert cell_decode_work(parts) == (3.5, 260.0)
    assert cell_decode_work([(CellWork(0, 0.0, 0.0, 0, 0.0), 0)]) == (0.0, 0.0)


def test_reports_carry_the_cells_decode_work_and_merge_it_where_every_report_has_it() -> None:
    """The verify ms a token per cell (the work the depth decides, without the prefills' swing):
    medians over reports, auto against off and the least fixed k's; a report from before it has
    none and merges without it."""
    reports = [_report_of(10.0, 18.0, 9.0), _report_of(30.0, 22.0, 11.0), _report_of(20.0, 30.0, 13.0)]
    for report, auto_ms in zip(reports, (4.4, 4.0, 4.2)):
        cells = {"off": 4.0, "k4": 4.1, "auto": auto_ms}
        report["decode_work"] = {"verify_ms_a_token": {"chat": {"16": dict(cells)}},
                                 "prefill_ms": {"chat": {"16": {n: 250.0 for n in cells}}}}
    merged = merge_reports(reports)
    assert merged["decode_work"]["verify_ms_a_token"]["chat"]["16"] == {"off": 4.0, "k4": 4.1, "auto": 4.2}
    assert "| chat | 16 | 4.00 (250) | 4.10 (250) | 4.20 (250) | 1.05x | 1.02x |" in render(merged)
    old = merge_reports([_report_of(10.0, 18.0, 9.0)])
    assert old["decode_work"] == {"verify_ms_a_token": {}, "prefill_ms": {}}
    assert "verify ms a token" not in render(old)
