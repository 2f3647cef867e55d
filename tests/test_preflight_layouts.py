"""Preflight's verdict against the launch's, over random parallel layouts (hypothesis).

Each layout (world size 1-8; pipeline, HSDP, tensor, context, expert and expert-tensor degrees;
2 to 8 routed experts, converted or left to torch; the pipeline's microbatches; the sequence
length, local batch and microbatch sizes, now and then zero, negative or not given) goes to `python
-m torchtitan_fp8_moe.preflight --target cpu` and to torchtitan's own Trainer on CPU ranks for
one step (tests/harness/trainer_batch.py), since some layouts only fail at step 1. Preflight must
refuse exactly the layouts the launch fails on. Issue #25's three layouts and the sizes of
SIZE_LAYOUTS are always among them.

The launches: one per world size, its layouts one after the other, through the session's fork
server (tests/harness/fork_launch.py). A layout that fails ends its launch (trainer_batch stops
every rank: a failed rank would leave the others waiting in a collective); the layouts after it
go to the next launch.

This module is also the launches' `experimental.custom_import`: importing it registers the
flavors below, in the preflight (pytest) process and in every rank.
"""

import dataclasses
import io
import json
import math
import subprocess
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from torchtitan.protocols.train_spec import get_train_spec

import torchtitan_fp8_moe.config  # noqa: F401 - registers float8_moe and llama4_grouped_shared
from torchtitan_fp8_moe.preflight import main as preflight_main

REPO = Path(__file__).resolve().parent.parent
CONFIG = "train_configs/llama4_debug.toml"
MODELS = ("llama4", "llama4_grouped_shared")  # shared experts as a FeedForward / a [1, ...] group
EXPERT_COUNTS = (2, 3, 4, 6, 8)
LAYOUTS = 15  # drawn ones, besides ISSUE_LAYOUTS: 30-90 s of launches on 2 cores
LAUNCH_TIMEOUT_S = 600


def flavor(experts: int) -> str:
    return f"preflight_{experts}experts"


def _register_flavors() -> None:
    """The debug model with 2 layers (one dense, one MoE: each step costs a second, not six)
    and each expert count."""
    for model in MODELS:
        flavors = get_train_spec(model).model_args
        base = flavors["debugmodel"]
        for experts in EXPERT_COUNTS:
            moe_args = dataclasses.replace(base.moe_args, num_experts=experts)
            flavors[flavor(experts)] = dataclasses.replace(base, n_layers=2, moe_args=moe_args)


_register_flavors()


@dataclasses.dataclass(frozen=True)
class Layout:
    world: int
    pp: int
    dp_replicate: int
    tp: int
    cp: int
    ep: int
    etp: int
    model: str
    experts: int
    local_batch: int  # the pipeline's microbatches (microbatch size 1)
    # False: float8_moe converts the shared experts only, so that the routed experts' EP and
    # FSDP rules are torch's and torchtitan's alone (the converter checks the weights it plans)
    fp8_routed: bool = True
    seq_len: int | None = 64  # None: not given, the config's (256)
    microbatch: int | None = None  # pipeline_parallel_microbatch_size; None: not given (1)

    @property
    def name(self) -> str:
        return (
            f"w{self.world}-pp{self.pp}-rep{self.dp_replicate}-tp{self.tp}-cp{self.cp}-"
            f"ep{self.ep}-etp{self.etp}-{self.model}-{self.experts}e-b{self.local_batch}"
            + ("" if self.fp8_routed else "-bf16routed")
            + ("" if self.seq_len == 64 else f"-seq{self.seq_len}")
            + ("" if self.microbatch is None else f"-mb{self.microbatch}")
        )

    def overrides(self) -> list[str]:
        """torchtitan overrides, the same for preflight and the launch (dp_shard takes the
        rest); activation checkpointing off, as EP with selective op AC is refused on CPU."""
        fqns = "experts,shared_expert" if self.fp8_routed else "shared_expert"
        sizes = [] if self.seq_len is None else [f"--training.seq_len={self.seq_len}"]
        if self.microbatch is not None:
            sizes.append(f"--parallelism.pipeline_parallel_microbatch_size={self.microbatch}")
        return [
            "--experimental.custom_import=test_preflight_layouts",
            f"--model.name={self.model}",
            f"--model.flavor={flavor(self.experts)}",
            f"--float8_moe.fqns={fqns}",
            *sizes,
            f"--training.local_batch_size={self.local_batch}",
            "--activation_checkpoint.mode=none",
            f"--parallelism.pipeline_parallel_degree={self.pp}",
            f"--parallelism.data_parallel_replicate_degree={self.dp_replicate}",
            "--parallelism.data_parallel_shard_degree=-1",
            f"--parallelism.tensor_parallel_degree={self.tp}",
            f"--parallelism.context_parallel_degree={self.cp}",
            f"--parallelism.expert_parallel_degree={self.ep}",
            f"--parallelism.expert_tensor_parallel_degree={self.etp}",
        ]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _one_or_a_divisor(n: int) -> st.SearchStrategy[int]:
    """Degree 1 half of the time: what the others leave is data-parallel ranks for EP."""
    return st.one_of(st.just(1), st.sampled_from(_divisors(n)))


@st.composite
def layouts(draw) -> Layout:
    """Degrees that multiply to the world size (ParallelDims' own check is not the point);
    EP mostly a degree that could fit, sometimes any."""
    world = draw(st.integers(1, 8))
    pp = draw(_one_or_a_divisor(world))
    dp_replicate = draw(_one_or_a_divisor(world // pp))
    tp = draw(_one_or_a_divisor(world // (pp * dp_replicate)))
    rest = world // (pp * dp_replicate * tp)
    cp = draw(st.sampled_from([1, 1, 1, 2])) if rest % 2 == 0 else 1
    experts = draw(st.sampled_from(EXPERT_COUNTS))
    fitting = _divisors(math.gcd(experts, rest * tp))
    ep = draw(st.one_of(st.sampled_from(fitting), st.integers(2, 8)))
    return Layout(
        world=world,
        pp=pp,
        dp_replicate=dp_replicate,
        tp=tp,
        cp=cp,
        ep=ep,
        etp=draw(st.sampled_from(sorted({1, tp}))),
        model=draw(st.sampled_from(MODELS)),
        experts=experts,
        # Sizes below 1 or not given now and then: each of those below 1 fails its launch.
        local_batch=draw(st.sampled_from([1, 2, 4] * 3 + [0, -1])),
        fp8_routed=draw(st.booleans()),
        seq_len=draw(st.sampled_from([64] * 8 + [None, 0, -64])),
        microbatch=draw(st.sampled_from([None] * 6 + [1, 0, -1])),
    )


def preflight_verdict(layout: Layout) -> str | None:
    """None when preflight plans the layout, else its message (exit status 2)."""
    argv = ["--config", CONFIG, "--ngpu", str(layout.world), "--target", "cpu"]
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = preflight_main(argv + layout.overrides())
    assert rc in (0, 2), out.getvalue() + err.getvalue()
    return None if rc == 0 else err.getvalue().strip().splitlines()[-1]


def _run_spec(layout: Layout, out: Path) -> dict:
    log_dir = out / layout.name
    log_dir.mkdir(parents=True, exist_ok=True)
    args = [f"--job.config_file={CONFIG}", *layout.overrides(), "--training.steps=1"]
    args.append(f"--job.dump_folder={log_dir}")
    return {"name": layout.name, "args": args, "log_dir": str(log_dir)}


def _logged_verdict(run: dict, world: int) -> tuple[bool, str | None]:
    """(whether every rank got through the run, the first error a rank logged)."""
    finished = 0
    for rank in range(world):
        path = Path(run["log_dir"]) / f"rank{rank}.log"
        text = path.read_text() if path.exists() else ""
        if f"trainer_batch: run {run['name']} failed:" in text:
            return False, text.split(" failed:\n", 1)[1].strip().splitlines()[-1]
        finished += f"trainer_batch: run {run['name']} finished" in text
    return finished == world, None


def launch_verdicts(server, world: int, layouts_of_world: list[Layout], out: Path) -> dict:
    """{layout: None when it trained a step, else the launch's error}, launching again after
    each layout that failed."""
    verdicts = {}
    todo = [_run_spec(layout, out) for layout in layouts_of_world]
    by_name = {layout.name: layout for layout in layouts_of_world}
    while todo:
        spec = out / f"w{world}-{len(verdicts)}.json"
        spec.write_text(json.dumps({"runs": todo}))
        argv = [f"--nproc={world}", "--preimport=test_preflight_layouts"]
        argv += [str(REPO / "tests" / "harness" / "trainer_batch.py"), str(spec)]
        try:
            proc = server.run(argv, {}, REPO, timeout=LAUNCH_TIMEOUT_S)
            ended = f"the launch exited with {proc.returncode}: {proc.stderr[-500:]}"
        except subprocess.TimeoutExpired:
            ended = f"the launch hung (killed after {LAUNCH_TIMEOUT_S} s)"
        for i, run in enumerate(todo):
            trained, error = _logged_verdict(run, world)
            if trained:
                verdicts[by_name[run["name"]]] = None
                continue
            verdicts[by_name[run["name"]]] = error or ended
            todo = todo[i + 1 :]
            break
        else:
            todo = []
    return verdicts


def draw_layouts(count: int) -> list[Layout]:
    """``count`` distinct layouts from hypothesis, one example each (a single example of a list
    strategy holds near-copies of one layout)."""
    drawn: list[Layout] = []

    @settings(max_examples=count * 3, phases=[Phase.generate], database=None, deadline=None)
    @given(layouts())
    def draw(layout):
        if layout not in drawn and len(drawn) < count:
            drawn.append(layout)

    draw()
    return drawn


# Issue #25's layouts, with the routed experts left to torch: 8 experts over EP 3 fail at step
# 1, 2 experts over EP 4 at start-up, EP 8 on 4 ranks in the device mesh.
ISSUE_LAYOUTS = [
    Layout(3, 1, 1, 1, 1, 3, 1, "llama4", 8, 2, fp8_routed=False),
    Layout(4, 1, 1, 1, 1, 4, 1, "llama4_grouped_shared", 2, 2, fp8_routed=False),
    Layout(4, 1, 1, 1, 1, 8, 1, "llama4", 8, 2, fp8_routed=False),
]


# Sizes below 1 (each fails at start-up or at step 1), one read only under pipeline parallelism,
# and a sequence length not given (the config's).
_TWO_RANKS = dict(world=2, pp=1, dp_replicate=1, tp=1, cp=1, ep=1, etp=1, model="llama4")
SIZE_LAYOUTS = [
    Layout(**_TWO_RANKS, experts=8, local_batch=2, seq_len=0),
    Layout(**_TWO_RANKS, experts=8, local_batch=2, seq_len=-64),
    Layout(**_TWO_RANKS, experts=8, local_batch=0),
    Layout(**_TWO_RANKS, experts=8, local_batch=2, microbatch=0),
    Layout(**dict(_TWO_RANKS, pp=2), experts=8, local_batch=2, microbatch=0),
    Layout(**_TWO_RANKS, experts=8, local_batch=2, seq_len=None),
]


def _verdict_table(layouts_: list[Layout], expected: dict, launched: dict) -> str:
    rows = []
    for layout in layouts_:
        agree = (expected[layout] is None) == (launched[layout] is None)
        rows.append(
            f"{'' if agree else 'DISAGREE '}{layout.name}\n  preflight: {expected[layout] or 'OK'}"
            f"\n  launch:    {launched[layout] or 'trained a step'}"
        )
    return "\n".join(rows)


@pytest.mark.slow  # a launch per world size and per failing layout: 30-90 s on 2 cores
def test_preflight_refuses_exactly_what_the_launch_fails_on(fork_server, tmp_path_factory):
    out = tmp_path_factory.mktemp("preflight_layouts")
    fixed = ISSUE_LAYOUTS + SIZE_LAYOUTS
    layout_list = fixed + [x for x in draw_layouts(LAYOUTS) if x not in fixed]
    expected = {layout: preflight_verdict(layout) for layout in layout_list}
    launched = {}
    for world in sorted({layout.world for layout in layout_list}):
        of_world = [layout for layout in layout_list if layout.world == world]
        launched.update(launch_verdicts(fork_server, world, of_world, out))
    table = _verdict_table(layout_list, expected, launched)
    print(table)  # pytest shows it with -s, and on a failure
    assert "DISAGREE" not in table, table
