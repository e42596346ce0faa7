"""Probe fitting reads nothing back per unit, fold, C value or Newton step (issue 26, item 1).

On a GPU every read of a device tensor by the host (`.item()`, `bool(t)`, `.tolist()`, `nonzero`,
boolean-mask indexing, `.cpu()`) waits for the queue to drain. The solvers used to ask after every
Newton step whether they had converged, after every pivoted-Cholesky column whether a unit was
still live, and per rank bucket how many steps it took; the sweep converted every unit's interval
to a float one at a time. Counted here on the CPU (`syncs.count_syncs`), on the accelerator
schedule (`check_every=EVERY`: the CPU's own default reads after each step, which is free there):
the count of a fit, a sweep and the permutation null is the same for 2 and 6 layers' worth of
units and for 8 and 16 tasks, and under a stated bound.

Measured before this change (same data, `syncs.count_syncs`), for (8 tasks, 2 layers) / (8, 6) /
(16, 2) / (16, 6): fit_logistic 172 / 172 / 185 / 180, the sweep 2228 / 2355 / 2441 / 2568, the
permutation null 39 / 39 / 63 / 63. After: 16, 958 and 11 at every size.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import TensorActivations
from syncs import count_syncs

from tomlens.probes.logistic import fit_logistic
from tomlens.probes.newton import newton_logistic
from tomlens.probes.selection import max_statistic_null
from tomlens.probes.splits import group_codes
from tomlens.probes.sweep import run_probe_sweep
from tomlens.probes.targets import make_target
from tomlens.stimuli import generate

pytestmark = pytest.mark.unit

EVERY = 8  # Newton steps between host reads: every warm-started solve here converges within 8
SIZES = [(8, 2), (8, 6), (16, 2), (16, 6)]  # (tasks: 128 or 256 prompts, layers)
FAST = dict(folds=3, inner_folds=2, c_grid=(0.1, 1.0), n_boot=50, progress=False, device="cpu")


def planted(n_tasks: int, layers: int, heads: int = 2, d: int = 16) -> TensorActivations:
    """Transfer stories whose every layer (and head) carries the belief weakly, in noise."""
    st = generate("unexpected-transfer", n=n_tasks, seed=0)
    g = torch.Generator().manual_seed(0)
    n = len(st)
    b = torch.tensor([2.0 * s.belief_is_reference - 1 for s in st])
    resid = torch.randn(n, layers, d, generator=g)
    resid[:, :, 0] += 1.5 * b.unsqueeze(1)
    head = torch.randn(n, layers, heads, d, generator=g)
    head[:, :, :, 1] += 1.5 * b.view(n, 1, 1)
    return TensorActivations(list(st), {("resid_post", "final"): resid, ("head_out", "final"): head},
                             {"model": {"model": "planted"}})


def _counted(fn) -> tuple[int, str]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with count_syncs() as c:
            fn()
    return c.total, c.summary()


def test_fit_logistic_reads_back_a_constant_whatever_the_units_and_rows():
    counts = {}
    for tasks, layers in SIZES:
        acts = planted(tasks, layers)
        X = acts.get("resid_post", "final").transpose(0, 1).contiguous()  # [unit, n, d]
        y, _ = make_target(acts.stimuli, "protagonist_belief")
        groups = [s.task_id for s in acts.stimuli]
        counts[(tasks, layers)] = _counted(lambda: fit_logistic(X, y.unsqueeze(0), groups=groups, c_grid=(0.1, 1.0), cv=2,
                                                                device="cpu", check_every=EVERY))
    totals = {k: v[0] for k, v in counts.items()}
    assert len(set(totals.values())) == 1, counts
    # per call: 5 Newton solves (2 folds x 2 C + the final fit), one read each on this schedule;
    # the inner folds' rows as host lists (2) and their codes (1); the results to the host in one
    # copy (1) and the fit-status summary (1); label and group checks on the host labels (~6)
    assert totals[(8, 2)] <= 5 + 3 + 2 + 6, counts


def test_a_probe_sweep_reads_back_the_same_whatever_its_units_and_rows():
    counts = {}
    for tasks, layers in SIZES:
        acts = planted(tasks, layers)
        counts[(tasks, layers)] = _counted(lambda: run_probe_sweep(
            acts, "protagonist_belief", sites=("resid_post",), check_every=EVERY,
            budget_minutes=None, **FAST))  # no plan: its timed fit is not the sweep's reads
    totals = {k: v[0] for k, v in counts.items()}
    assert len(set(totals.values())) == 1, counts
    # 36 fits (activations and 3 text baselines, 3 folds x 3 train/test plans each, minus what the
    # transfer set's conditions drop), each about 16 reads in fit_logistic and a dozen in the sweep's
    # bookkeeping of the host's label tensors (unique / equal / .cpu of CPU tensors: no GPU wait),
    # plus the bootstrap intervals per plan and metric
    assert totals[(8, 2)] <= 1000, counts


def test_the_permutation_null_reads_back_once():
    counts = {}
    for tasks, layers in SIZES:
        acts = planted(tasks, layers)
        units = [acts.get("resid_post", "final").transpose(0, 1).contiguous(),
                 acts.get("head_out", "final").flatten(1, 2).transpose(0, 1).contiguous()]
        y, _ = make_target(acts.stimuli, "protagonist_belief")
        groups = group_codes(acts.stimuli)
        counts[(tasks, layers)] = _counted(lambda: max_statistic_null(units, y, groups, folds=3, n_permutations=50,
                                                                      device="cpu"))
    totals = {k: v[0] for k, v in counts.items()}
    assert len(set(totals.values())) == 1, counts
    # the maxima to the host once (1) and the observed one as a float (1); the rest reads the host's
    # own label tensors (no GPU wait): labels and groups as lists (5: for the permutation scheme,
    # the permutations, the folds and the labels), the classes (1), each fold's training rows (3)
    assert totals[(8, 2)] <= 2 + 5 + 1 + 3, counts


def test_before_the_change_a_fit_read_back_per_step_and_now_it_does_not():
    """The count of one Newton solve does not grow with its steps: a cold start on separable data
    takes many steps, a warm one few, and both read back once per `EVERY` steps."""
    g = torch.Generator().manual_seed(0)
    y = (torch.arange(64) % 2).double()
    Z = torch.randn(3, 64, 5, generator=g, dtype=torch.float64)
    Z[:, :, 0] += 4 * (2 * y - 1)  # nearly separable: weak penalty, many steps
    Y = y.view(1, 64, 1).expand(3, 64, 1).contiguous()
    inv_c = torch.full((3, 1), 1e-3, dtype=torch.float64)
    many, _ = _counted(lambda: newton_logistic(Z, Y, inv_c, check_every=100, validate=False))
    steps = int(newton_logistic(Z, Y, inv_c).n_iter.max())
    assert steps > 4
    assert many == 1  # one read, at step 100 = max_iter, however many steps it took
    per_step, _ = _counted(lambda: newton_logistic(Z, Y, inv_c, check_every=1, validate=False))
    assert per_step >= steps  # the CPU's schedule: a read after each step (free there)


def degenerate_units() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Units whose Hessians need damping or whose steps need backtracking, next to plain ones."""
    g = torch.Generator().manual_seed(0)
    m = 40
    y = (torch.arange(m) % 2).double()
    sign = 2 * y - 1
    base = lambda r=6: torch.randn(m, r, generator=g, dtype=torch.float64)  # noqa: E731
    plain = base() + 0.8 * sign.unsqueeze(1)
    sep = base()
    sep[:, 0] = 50 * sign  # separable at a huge margin: the full step overshoots
    square = 1e3 * torch.randn(m, 6, generator=g, dtype=torch.float64)
    square[:, 1] = square[:, 0]  # duplicated columns at |x| ~ 1e3
    nan = base()
    nan[3, 2] = torch.nan
    Z = torch.stack([plain, sep, square, torch.zeros(m, 6, dtype=torch.float64), nan])
    Y = torch.stack([y, 1 - y], 1).unsqueeze(0).expand(5, m, 2).contiguous()
    inv_c = torch.tensor([0.1, 10.0], dtype=torch.float64).expand(5, 2).contiguous()
    return Z, Y, inv_c


@pytest.mark.parametrize("solve_dtype", [torch.float64, torch.float32])
def test_the_accelerator_schedule_takes_the_same_steps_as_the_cpu_schedule(solve_dtype):
    """Damping one rung per step and backtracking on the device give the iterates, step counts and
    statuses of deciding on the host after every step."""
    Z, Y, inv_c = degenerate_units()
    host = newton_logistic(Z, Y, inv_c, solve_dtype=solve_dtype, check_every=1)
    device = newton_logistic(Z, Y, inv_c, solve_dtype=solve_dtype, check_every=4)
    torch.testing.assert_close(device.beta, host.beta, rtol=1e-12, atol=1e-12, equal_nan=True)
    assert torch.equal(device.status, host.status)
    assert torch.equal(device.n_iter, host.n_iter)


def test_fit_logistic_gives_the_same_probes_on_both_schedules():
    acts = planted(8, 3)
    X = acts.get("head_out", "final").flatten(1, 2).transpose(0, 1).contiguous()
    low = X[:, :, :4] @ torch.randn(4, 24, generator=torch.Generator().manual_seed(1))  # rank-4 units: row basis
    y, _ = make_target(acts.stimuli, "protagonist_belief")
    Y = torch.stack([y, 1 - y, (torch.arange(y.numel()) % 3 == 0).long()])
    groups = [s.task_id for s in acts.stimuli]
    for features in (X, low):
        cpu = fit_logistic(features, Y, groups=groups, device="cpu", check_every=1)
        gpu = fit_logistic(features, Y, groups=groups, device="cpu", check_every=EVERY)
        torch.testing.assert_close(gpu.coef, cpu.coef, rtol=1e-12, atol=1e-12, equal_nan=True)
        torch.testing.assert_close(gpu.intercept, cpu.intercept, rtol=1e-12, atol=1e-12, equal_nan=True)
        assert torch.equal(gpu.C, cpu.C) and torch.equal(gpu.status, cpu.status)
