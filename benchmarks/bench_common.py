"""Shared pieces of the benchmark scripts: core pinning, the cached doubling base and rewards,
and the record of every run.

Every script pins itself (and each contender subprocess) to one core with ``taskset`` and
runs torch with one intra-op thread, so contenders see the same hardware.

Every run a script measures becomes one row (:func:`record`): with ``--record`` it is appended to
``benchmarks/results/<benchmark>.jsonl``, the committed record that ``benchmarks/render.py`` turns
into the tables of the docs; without it, to ``--out/results.jsonl``, a scratch file under the
ignored ``runs/``, so a smoke run never lands in the record.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

DEFAULT_OUT = "runs/bench_tutorial"
RESULTS = "results.jsonl"  # under a script's --out: every run it made, read back by its --report
RECORD_DIR = Path(__file__).resolve().parent / "results"  # the committed record: <benchmark>.jsonl
ROOT = Path(__file__).resolve().parents[1]


def commit() -> str:
    """The checked-out commit (short), to date a stored result; ``$RLHFKIT_BENCH_COMMIT`` when set
    (a copy of the tree sent to another machine, whose git history may be missing or stale)."""
    if os.environ.get("RLHFKIT_BENCH_COMMIT"):
        return os.environ["RLHFKIT_BENCH_COMMIT"]
    return _git("rev-parse", "--short", "HEAD") or "unknown"


def dirty() -> bool | None:
    """Whether the work tree differs from the commit outside ``benchmarks/results/`` (the record
    itself changes with every run); None without git (``$RLHFKIT_BENCH_COMMIT`` set: unknown)."""
    if os.environ.get("RLHFKIT_BENCH_COMMIT"):
        return None
    status = _git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!benchmarks/results")
    return None if status is None else bool(status)


def _git(*args: str) -> str | None:
    """``git args`` in the repository, its stripped output; None when git fails."""
    try:
        out = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)
    except OSError:
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def cpu() -> str:
    """The CPU, as precisely as Linux names it: machines sold under one name (a 2-core "AMD
    EPYC" virtual machine) differ by generation, and with it by how fast each library's matrix
    products run, so a stored result carries the family and model numbers too."""
    fields = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if not line.strip():
                    break  # the first processor's block is enough
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in fields:
        name += f" (family {fields['cpu family']}, model {fields.get('model', '?')})"
    return name


def versions() -> dict[str, str | None]:
    """The versions of rlhfkit (the imported package's: an editable install's metadata can be
    stale) and of the libraries a result depends on (None: not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    import rlhfkit

    found = {"rlhfkit": rlhfkit.__version__}
    for name in ("torch", "transformers", "peft", "trl"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def allocator(device: str) -> str:
    """Which allocator served the tensors: on a GPU torch's caching allocator (with its
    ``PYTORCH_CUDA_ALLOC_CONF``), on a CPU the malloc preloaded in ``LD_PRELOAD`` or glibc's."""
    if device.startswith("cuda"):
        conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
        return "cuda caching" + (f" ({conf})" if conf else "")
    preloaded = [Path(p).name for p in os.environ.get("LD_PRELOAD", "").replace(":", " ").split()]
    return next((name for name in ("tcmalloc", "jemalloc") if any(name in p for p in preloaded)), "glibc")


def device_name(device: str) -> str:
    """``cpu`` or the GPU's name (``NVIDIA H100 80GB HBM3``)."""
    return torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else "cpu"


def code_version() -> dict:
    """The code a run measures: the commit and whether the work tree differed from it."""
    return {"commit": commit(), "dirty": dirty()}


def stamp(device: str = "cpu", dtype: str = "fp32", at: dict | None = None) -> dict:
    """Where and with what a run was measured: the code (``at``, :func:`code_version` taken when
    the run started; default now), library versions, machine (CPU model, cores), device, dtype,
    allocator, torch threads, date."""
    return {**(at or code_version()), "versions": versions(),
            "machine": {"cpu": cpu(), "cores": os.cpu_count()}, "device": device_name(device), "dtype": dtype,
            "allocator": allocator(device), "threads": torch.get_num_threads(),
            "date": time.strftime("%Y-%m-%d", time.gmtime())}


def add_record_args(ap) -> None:
    """``--record``: the switch every benchmark that writes rows takes (:func:`record`)."""
    ap.add_argument("--record", action="store_true",
                    help="append every run to benchmarks/results/<benchmark>.jsonl, the committed record the docs "
                         "render (default: --out/results.jsonl, a scratch file)")


def results_path(benchmark: str, args) -> Path:
    """Where a script's runs go: the committed record with ``args.record``, else the scratch file
    under ``args.out``."""
    return RECORD_DIR / f"{benchmark}.jsonl" if args.record else Path(args.out) / RESULTS


def record(benchmark: str, row: dict, args, device: str = "cpu", dtype: str = "fp32", at: dict | None = None) -> dict:
    """Append one run to :func:`results_path` and return it as written. ``row`` holds what the
    script measured and how: ``contender``, ``settings`` (every setting that tells this run from
    another's), ``seeds``, ``times_s`` (every timed repeat, not a summary), ``peak_mib`` and the
    benchmark's own metrics; :func:`stamp` adds commit, versions, machine, device, dtype,
    allocator and threads (a key of ``row`` wins: a worker run under another allocator says so)."""
    full = {"benchmark": benchmark, **stamp(device, dtype, at), **row}
    path = results_path(benchmark, args)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(full) + "\n")
    return full


def stored_results(path: Path, match: dict) -> list[dict]:
    """The runs in ``path`` (:func:`results_path`) whose keys hold the values in ``match``, oldest
    first. A run given a ``superseded`` key by hand (its reason: the code it measured was
    replaced) stays in the file and out of the tables."""
    rows = map(json.loads, path.read_text().splitlines() if path.exists() else [])
    return [r for r in rows if "superseded" not in r and all(r.get(k) == v for k, v in match.items())]


def pin_to_core(core: int = 0) -> None:
    """Re-exec this script under ``taskset -c core`` (once) and use one torch thread."""
    if os.environ.get("RLHFKIT_BENCH_PINNED") != "1" and shutil.which("taskset"):
        os.environ["RLHFKIT_BENCH_PINNED"] = "1"
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        os.execvp("taskset", ["taskset", "-c", str(core), sys.executable, *sys.argv])
    torch.set_num_threads(1)


def pinned_cmd(core: int, *args: str) -> list[str]:
    """Command line running this Python on ``core`` (for contender subprocesses)."""
    prefix = ["taskset", "-c", str(core)] if shutil.which("taskset") else []
    return [*prefix, sys.executable, *args]


def worker_setup(args) -> dict[str, str]:
    """A contender process's start: pinned to ``args.core`` with one thread, every timer on
    this process's CPU seconds if ``args.clock == 'cpu'``, quiet transformers; returns the
    cached base / reward model paths (:func:`prepare`)."""
    import time

    pin_to_core(args.core)
    if args.clock == "cpu":  # every timer of both libraries reads this process's CPU seconds instead
        time.perf_counter = time.process_time
    quiet_hf()
    return prepare(args.out)


def quiet_hf() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def prepare(out: Path | str = DEFAULT_OUT, seed: int = 0) -> dict[str, str]:
    """Pretrained doubling base, pairwise reward model and label-classifier reward model,
    built once and cached under ``out``. Returns their paths."""
    from rlhfkit.config import Config
    from rlhfkit.trainers.pretrain import pretrain
    from rlhfkit.trainers.reward import train_reward_model

    out = Path(out)
    paths = {"base": out / "pretrain" / "policy", "rm": out / "reward" / "reward_model",
             "classifier": out / "reward_classifier" / "reward_model"}
    # overwrite: a preparation killed before its model was saved is redone
    cfg = Config().replace(run={"seed": seed, "progress": False, "overwrite": True})
    if not (paths["base"] / "config.json").exists():
        print("preparing the base model (cached for later runs) ...", flush=True)
        pretrain(cfg.replace(run={"out_dir": str(out / "pretrain")}))
    if not (paths["rm"] / "config.json").exists():
        print("preparing the pairwise reward model ...", flush=True)
        train_reward_model(cfg.replace(run={"out_dir": str(out / "reward")}), policy_path=str(paths["base"]))
    if not (paths["classifier"] / "config.json").exists():
        print("preparing the classifier reward model ...", flush=True)
        train_reward_model(cfg.replace(run={"out_dir": str(out / "reward_classifier")}, reward={"kind": "classifier"}),
                           policy_path=str(paths["base"]))
    return {k: str(v) for k, v in paths.items()}


class ClassifierReward:
    """The doubling tutorial's classifier reward as a plain callable ``(prompts, completions, **kw) -> list[float]``:
    the label classifier's logit, at the last token of prompt + completion, of the character
    set the prompt asks for. ``completions`` are response texts with EOS kept (rlhfkit's
    decode); a trainer that strips special tokens passes ``completion_ids`` instead, which are
    decoded here with EOS kept, so both see the same text and get the same number.
    """

    def __init__(self, path: str):
        from transformers import AutoTokenizer

        from rlhfkit.models.forward import freeze, load_scalar_model

        self.tok = AutoTokenizer.from_pretrained(path)
        self.model = freeze(load_scalar_model(path, num_labels=None))
        self.__name__ = "classifier_reward"

    @torch.no_grad()
    def __call__(self, prompts: list[str], completions: list, completion_ids=None, **kw) -> list[float]:
        from rlhfkit.models.forward import sequence_logits
        from rlhfkit.tasks.doubling import BOS, label_of_prompt

        if completion_ids is not None:
            completions = self.tok.batch_decode(completion_ids, skip_special_tokens=False)
        prompts = [p[len(BOS):] if p.startswith(BOS) else p for p in prompts]  # the tokenizer adds BOS
        enc = self.tok([p + c for p, c in zip(prompts, completions)], padding=True, return_tensors="pt")
        logits = sequence_logits(self.model, enc["input_ids"], enc["attention_mask"])  # [B, L]
        labels = torch.tensor([label_of_prompt(p) for p in prompts])
        return logits.gather(1, labels[:, None]).squeeze(1).tolist()


def exact_reward_with_ids(tok):
    """rlhfkit's exact-match verifier for a trainer that strips special tokens from completions:
    re-decodes ``completion_ids`` with EOS kept (the verifier needs to see the EOS)."""
    from rlhfkit.tasks.doubling import exact_reward

    def exact(prompts, completions, completion_ids=None, **kw):
        if completion_ids is not None:
            completions = tok.batch_decode(completion_ids, skip_special_tokens=False)
        return exact_reward(prompts, completions)

    exact.__name__ = "exact_reward"
    return exact


TRL_GRPO_LR = 5e-4
TRL_GRPO_BETA = 0.1


def trl_grpo_config(output_dir: str, seed: int, max_steps: int, lr: float = TRL_GRPO_LR, beta: float = TRL_GRPO_BETA,
                    num_generations: int = 8, batch_size: int = 64, overrides: dict | None = None):
    """TRL's GRPOConfig: its documented defaults (loss 'dapo', group-scaled rewards, epsilon 0.2,
    one iteration per generation, temperature 1, no top-k / top-p) adapted to the doubling task:
    64 completions per step in one optimizer step, 8-token completions, float32 and no
    gradient checkpointing on a CPU, a constant learning rate and KL weight chosen by a sweep
    (time_to_accuracy.py's docstring). The default lr 1e-6 is for billion-parameter models.
    ``overrides``: further GRPOConfig keywords, which win over all of the above."""
    from trl import GRPOConfig

    kw = dict(
        output_dir=output_dir, learning_rate=lr, lr_scheduler_type="constant", beta=beta,
        num_generations=num_generations, per_device_train_batch_size=batch_size, gradient_accumulation_steps=1,
        max_completion_length=8, max_steps=max_steps, bf16=False, gradient_checkpointing=False, use_cpu=True,
        seed=seed, logging_steps=10, log_level="error", report_to="none", save_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0,
    )
    return GRPOConfig(**{**kw, **(overrides or {})})


class PhaseClock:
    """Marks inside a step: ``mark(name)`` closes the phase running since the previous mark and
    records its seconds in ``rows`` and, on Linux, the phase's peak resident set (MiB) in
    ``peaks``: the high-water mark is reset at every mark (``/proc/self/clear_refs``), so each
    phase's peak is its own. With ``cuda``, every mark waits for the GPU's queued work first and
    the peak is the CUDA allocator's (``torch.cuda.max_memory_allocated``, reset at each mark)."""

    def __init__(self, cuda: bool = False):
        self.cuda = cuda  # time after the GPU's queued work and read the allocator's peak instead of VmHWM
        self.rows: list[dict[str, float]] = []
        self.peaks: list[dict[str, float]] = []
        self.t = None
        self.cur: dict[str, float] = {}
        self.cur_peak: dict[str, float] = {}
        self.rss_at_first_start: float | None = None

    def start(self):
        """Open a step (a no-op while one is open)."""
        if self.t is not None:
            return
        if self.cuda:
            torch.cuda.synchronize()
        if self.rss_at_first_start is None:
            self.rss_at_first_start = torch.cuda.memory_allocated() / 2**20 if self.cuda else proc_status_mib("VmRSS")
        self._reset_peak()
        self.t, self.cur, self.cur_peak = time.perf_counter(), {}, {}

    def _reset_peak(self):
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        else:
            reset_peak_rss()

    def mark(self, name: str):
        if self.cuda:
            torch.cuda.synchronize()
        now = time.perf_counter()
        if self.t is not None and name not in self.cur:
            self.cur[name] = now - self.t
            self.cur_peak[name] = torch.cuda.max_memory_allocated() / 2**20 if self.cuda else proc_status_mib("VmHWM")
            self._reset_peak()
            self.t = now

    def end(self, name: str):
        self.mark(name)
        self.rows.append(self.cur)
        self.peaks.append(self.cur_peak)
        self.t = None


def marked(fn, clock: PhaseClock, name: str, start: bool = False, end: bool = False):
    """``fn`` that also marks ``clock``: opens a step before the call (``start``), closes phase
    ``name`` after it (and the step, ``end``)."""

    def wrapper(*a, **kw):
        if start:
            clock.start()
        result = fn(*a, **kw)
        (clock.end if end else clock.mark)(name)
        return result

    return wrapper


def clock_grpo_trainer(trainer, clock: PhaseClock) -> None:
    """Time TRL's GRPOTrainer from the outside: a step opens at the optimizer step's start (or at
    generation), rollout ends with ``_generate``, experience with
    ``_generate_and_score_completions`` (reference log-probs, rewards, advantages), update with
    the optimizer step."""
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def on_step_begin(self, a, s, control, **kw):
            clock.start()

        def on_step_end(self, a, s, control, **kw):
            clock.end("update")

    trainer._generate = marked(trainer._generate, clock, "rollout", start=True)
    trainer._generate_and_score_completions = marked(trainer._generate_and_score_completions, clock, "experience")
    trainer.add_callback(Clock())


def proc_status_mib(field: str) -> float:
    """A memory field of ``/proc/self/status`` (VmRSS: now; VmHWM: peak since the last reset), in MiB;
    NaN off Linux."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def reset_peak_rss() -> bool:
    """Reset the process's resident-set high-water mark (VmHWM, what ``ru_maxrss`` reads) to the
    current resident set (Linux)."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def peak_rss_mib() -> float:
    """Peak resident set size of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
