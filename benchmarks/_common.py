"""Pieces the benchmark scripts share."""

import statistics
import time

# `--jit-compile`'s values, as `compile(jit_compile=...)` takes them.
JIT_COMPILE = {"auto": "auto", "true": True, "false": False}


def built_for(keras, config, build):
    """`build()` for a configuration, seed 0: under Keras's own global
    policy where `config` is `"keras <policy>"` (float32 again after it,
    also on an error), else in float32 for keras_mp to set its level."""
    keras.utils.set_random_seed(0)
    keras.config.set_dtype_policy(config.split()[1] if config.startswith("keras ") else "float32")
    try:
        return build()
    finally:
        keras.config.set_dtype_policy("float32")


def level_of(config):
    """`(level, dtype)` of a keras_mp configuration: `"O2 bfloat16 +head"`
    gives `("O2", "bfloat16")`, `"O0"` gives `("O0", "float16")` (unused)."""
    level, dtype = (config.split() + ["float16"])[:2]
    return level, dtype


def fastest_decile(samples):
    """Mean of the fastest tenth of the samples (at least one).

    Noise on a shared machine only adds time, so this is the steadier
    estimate of what a step costs; unlike medians of ratios, ratios of these
    compose (a/b times b/c is a/c).
    """
    fast = sorted(samples)[: max(1, len(samples) // 10)]
    return sum(fast) / len(fast)


def time_paired(runs, samples, steps):
    """Per-step times of each runner, paired: every sample times each in turn.

    `runs` maps a name to a function that runs `n` steps and waits for them.
    The order alternates between samples, so that no variant always runs
    right after the same one. Returns a dict of lists of seconds per step.
    """
    names = list(runs)
    times = {name: [] for name in names}
    for sample in range(samples):
        for name in names if sample % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            runs[name](steps)
            times[name].append((time.perf_counter() - start) / steps)
    return times


def add_step_arguments(parser, samples):
    """--samples, --steps and --batch, for the scripts that time one step."""
    parser.add_argument("--samples", type=int, default=samples)
    parser.add_argument("--steps", type=int, default=20, help="steps per sample")
    parser.add_argument("--batch", type=int, default=64)


def check_step_arguments(parser, args):
    if min(args.samples, args.steps, args.batch) < 1:
        parser.error(
            "--samples, --steps and --batch must be positive, got "
            f"{args.samples}, {args.steps} and {args.batch}"
        )


def report_paired(runs, args, title):
    """Warms each runner up, times them paired, prints the ratios to plain."""
    for run in runs.values():
        run(args.steps)
    times = time_paired(runs, args.samples, args.steps)
    print(
        f"{title}, batch {args.batch}, plain step "
        f"{statistics.median(times['plain']) * 1e6:.0f} us, {args.samples} paired samples"
    )
    print_ratio_table(times)


def print_ratio_table(times, base="plain"):
    """Markdown table of each variant's paired ratios to `base`."""
    print(
        f"| variant | median ratio to {base} | quartiles | fastest decile's ratio |\n"
        "|---|---|---|---|"
    )
    base_fast = fastest_decile(times[base])
    for name, samples in times.items():
        ratios = sorted(a / b for a, b in zip(samples, times[base]))
        q = len(ratios) // 4
        print(
            f"| {name} | {statistics.median(ratios):.3f} | {ratios[q]:.3f}–{ratios[-q - 1]:.3f} "
            f"| {fastest_decile(samples) / base_fast:.3f} |"
        )


def without_telemetry(model):
    """Gives a compiled model back Keras's own train step and `fit`: no
    `loss_scale`/`skipped_steps` in any logs, nothing of keras_mp's around the
    step (its optimizer still runs inside)."""
    model.__dict__.pop("train_step", None)
    model.__dict__.pop("fit", None)
    model.train_function = None
