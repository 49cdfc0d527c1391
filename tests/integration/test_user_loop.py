"""The user's own loop on real engines (``Cluster.run``): scripts as their authors write them against their pscluster
versions (``loops/``), with plain torch as the reference."""

import contextlib
import difflib
import inspect
import statistics
import time

import pytest
import torch

import pscluster
from pscluster.errors import ConfigError

from .conftest import events, mlp, wait_for_step
from .loops import gan_plain, gan_pscluster, gpt_plain, gpt_pscluster, mnist_plain, mnist_pscluster

pytestmark = pytest.mark.integration
CHANGED_LINES = 10  # the most lines a script may need changed (written anew or rewritten) to run on pscluster


def changed_lines(plain, ported) -> tuple[int, int]:
    """(lines of the pscluster version written anew or rewritten, lines of the plain script removed) between the two
    modules' sources."""
    diff = [line for line in difflib.unified_diff(inspect.getsource(plain).splitlines(),
                                                  inspect.getsource(ported).splitlines(), n=0, lineterm="")
            if not line.startswith(("+++", "---", "@@"))]
    return sum(line.startswith("+") for line in diff), sum(line.startswith("-") for line in diff)


@contextlib.contextmanager
def threads(n: int):
    """Torch's intra-op threads set to ``n`` (a worker's, ``Cluster.threads``): a conv net's sums are ordered by them,
    and a plain reference equal to the bit runs with the worker's."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def max_diff(got: dict, expected: dict) -> float:
    assert got.keys() == expected.keys()
    return max((got[k] - expected[k]).abs().max().item() for k in expected)


@pytest.fixture(scope="module")
def one_worker(start_cluster):
    return start_cluster(ps=1, workers=1)


@pytest.fixture(scope="module")
def two_workers(start_cluster):
    return start_cluster(ps=2, workers=2)


def test_an_mnist_script_with_dropout_adadelta_and_steplr_on_one_worker_is_the_plain_script(one_worker):
    added, removed = changed_lines(mnist_plain, mnist_pscluster)
    assert added <= CHANGED_LINES, f"{added} lines of the pscluster version differ from the plain script"
    run = one_worker.run(mnist_pscluster.main, mode="sync", steps=60, seed=1).wait(verbose=False)
    assert run.status == "finished" and run.global_step == 60 and run.local_steps == [60]
    with threads(one_worker.threads):
        expected = mnist_plain.main(seed=1, steps=60).state_dict()
    assert max_diff(run.state_dict(), expected) <= 1e-5
    assert max_diff(run.state_dict(), mnist_plain.Net().state_dict()) > 1e-2  # it trained
    logged = run.metrics()
    assert len(logged) == 60 and logged["loss"].notna().all()  # ctx.log's loss is the step's loss


def test_a_nanogpt_style_loop_on_one_worker_is_the_plain_loop(one_worker):
    """AdamW with tensor param groups, the learning rate set in param_groups each iteration, 2 micro-batches
    accumulated, clipping, bf16 autocast, the chief evaluating every 10 steps."""
    added, removed = changed_lines(gpt_plain, gpt_pscluster)
    assert added <= CHANGED_LINES, f"{added} lines of the pscluster version differ from the plain script"
    run = one_worker.run(gpt_pscluster.main, mode="sync", steps=40, seed=1337).wait(verbose=False)
    with threads(one_worker.threads):
        model, val_losses = gpt_plain.main(seed=1337, max_iters=40)
    assert run.global_step == 40
    assert max_diff(run.state_dict(), model.state_dict()) <= 1e-5
    metrics = run.metrics()
    logged = metrics["val_loss"].dropna().tolist()
    assert logged == pytest.approx(val_losses, abs=1e-5)  # ctx.log's numbers, with the step they went with
    groups = run.plan.optimizer_groups  # the tensor groups arrived by name: decay on matrices only
    assert groups[0]["weight_decay"] == 0.1 and all("bias" not in p and "ln_" not in p for p in groups[0]["params"])


def amp_loop(ctx=None, *, seed=7, steps=24):
    """Mixed precision as torch's AMP recipe writes it: fp16 autocast, a GradScaler whose first scale overflows
    (those steps are skipped: no optimizer.step(), no exchange), the gradients unscaled and clipped before the
    step of a fused Adam (which a GradScaler would otherwise hand the scale to unscale in its own step). Without
    ``ctx``: the plain loop. Returns the model and the steps the scaler skipped."""
    torch.manual_seed(ctx.seed if ctx else seed)
    model = mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3, fused=True)
    if ctx is not None:
        model, optimizer = ctx.model(model), ctx.optimizer(optimizer)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**30, growth_interval=4)
    features, labels = pscluster.datasets.digits("train").tensors()
    skipped = 0
    for i in range(steps):
        x, y = features[i * 16:(i + 1) * 16], labels[i * 16:(i + 1) * 16]
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scale = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        skipped += scaler.get_scale() < scale
    return model, skipped


def test_a_grad_scaler_in_the_loop_skips_and_steps_as_in_plain_torch(one_worker):
    run = one_worker.run(amp_loop, steps=24, seed=7).wait(verbose=False)
    with threads(one_worker.threads):
        model, skipped = amp_loop(seed=7)
    assert skipped > 0  # the skip path was taken
    assert run.status == "finished" and run.global_step == 24 - skipped  # a skipped step is no global step
    assert max_diff(run.state_dict(), model.state_dict()) <= 1e-5


def test_the_loop_stops_the_run_early_and_says_why(one_worker):
    with threads(one_worker.threads):
        _, plain_losses = gpt_plain.main(seed=1337, max_iters=40)
    threshold = plain_losses[2] + 1e-3  # the plain loop's validation loss at its third evaluation (step 20)
    run = one_worker.run(lambda ctx: gpt_pscluster.main(ctx, stop_below=threshold), steps=40,
                         seed=1337).wait(verbose=False)
    assert run.status == "finished" and run.global_step == 20
    requested = events(run, "stop_requested")
    assert len(requested) == 1 and requested["detail"].iloc[0]["reason"].startswith("validation loss")
    with threads(one_worker.threads):
        model, _ = gpt_plain.main(seed=1337, max_iters=20)
    assert max_diff(run.state_dict(), model.state_dict()) <= 1e-5


def test_a_dcgan_style_loop_with_two_optimizers_on_one_worker_is_the_plain_loop(one_worker):
    """Generator and discriminator registered apart (by name in the state_dict), each its own Adam, stepped in the
    loop's order; the generator's steps are the global steps."""
    added, removed = changed_lines(gan_plain, gan_pscluster)
    assert added <= CHANGED_LINES, f"{added} lines of the pscluster version differ from the plain script"
    run = one_worker.run(gan_pscluster.main, mode="sync", steps=30, seed=3).wait(verbose=False)
    with threads(one_worker.threads):
        netG, netD, losses = gan_plain.main(seed=3, steps=30)
    assert run.global_step == 30 and run.local_steps == [30]
    expected = {**{f"Generator.{k}": v for k, v in netG.state_dict().items()},
                **{f"Discriminator.{k}": v for k, v in netD.state_dict().items()}}
    assert max_diff(run.state_dict(), expected) <= 1e-5
    assert run.metrics()["loss_d"].tolist() == pytest.approx(losses, abs=1e-5)
    assert [s.optimizer for s in run.plan.optimizer_specs] == ["Adam", "Adam"]


def record_random(ctx):
    model = ctx.model(mlp())
    optimizer = ctx.optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    for x, y in ctx.endless_shard(pscluster.datasets.digits("train"), batch_size=16):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        ctx.log(drawn=torch.rand(()).item(), seed=ctx.seed)
        if ctx.should_stop():
            break


def drawn(run) -> dict[int, list[float]]:
    rows = run.metrics().sort_values("local_step")
    return {w: g["drawn"].tolist() for w, g in rows.groupby("worker")}


def test_each_worker_draws_its_own_random_numbers_and_a_seed_draws_them_again(two_workers):
    first = two_workers.run(record_random, steps=20, seed=5).wait(verbose=False)
    again = two_workers.run(record_random, steps=20, seed=5).wait(verbose=False)
    values = drawn(first)
    assert len(values[0]) == len(values[1]) == 20
    assert all(a != b for a, b in zip(values[0], values[1]))  # worker 0 and worker 1 differ at every step
    assert drawn(again) == values
    seeds = first.metrics().groupby("worker")["seed"].first()
    assert seeds[0] == 5 and seeds[1] != 5  # ctx.seed: the chief's first attempt has the run's


def test_train_fn_runs_once_on_each_worker_and_what_it_prints_before_its_first_step_arrives(two_workers, tmp_path):
    calls = tmp_path / "calls"

    def train_fn(ctx):
        with open(calls, "a") as f:  # what a loop loads before its model, once on each worker
            f.write(f"{ctx.worker_index}\n")
        print(f"loading on {ctx.worker_index}")
        model = ctx.model(mlp())
        optimizer = ctx.optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        while not ctx.should_stop():
            optimizer.zero_grad()
            model(torch.ones(4, 64)).sum().backward()
            optimizer.step()

    run = two_workers.run(train_fn, steps=3).wait(verbose=False)
    assert sorted(calls.read_text().split()) == ["0", "1"]
    for i in range(2):
        assert run.logs.count(f"[worker:{i}] loading on {i}") == 1


def never_asks(ctx):
    """A loop that never calls ``should_stop()``, over epochs without end: only the run's end ends it."""
    model = ctx.model(mlp())
    optimizer = ctx.optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    while True:
        for x, y in ctx.shard(pscluster.datasets.digits("train"), batch_size=16):
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()


def test_a_loop_that_never_asks_should_stop_ends_at_the_target_and_at_a_stop(two_workers):
    run = two_workers.run(never_asks, mode="async", steps=40).wait(timeout=120, verbose=False)
    assert run.status == "finished" and run.global_step == 40
    assert run.logs and any("went on after the run's end (its target of 40" in line for line in run.logs)
    assert ": epoch 1 · global step 40 / 40," in repr(run)  # ~45 batches an epoch: both workers in their first
    run = two_workers.run(never_asks, mode="sync")  # no target: a stop alone ends it
    wait_for_step(run, 5)
    stopped = time.monotonic()
    run.stop()
    run.wait(timeout=60, verbose=False)
    took = time.monotonic() - stopped
    assert run.status == "stopped" and sum(run.local_steps) > 0
    assert took < 20, f"the loops ended {took:.1f}s after the stop"  # hung for minutes before ctx.shard ended


def test_train_gives_each_worker_its_own_random_stream(two_workers, digits_train):
    def step_fn(model, batch):
        x, y = batch
        return torch.nn.functional.cross_entropy(model(x), y), {"drawn": torch.rand(())}

    run = two_workers.train(mlp, digits_train, step_fn=step_fn, lr=0.1, steps=15, batch_size=16,
                            seed=5).wait(verbose=False)
    values = drawn(run)
    assert all(a != b for a, b in zip(values[0], values[1]))


def test_two_workers_sync_and_async_converge_as_plain_torch_does(two_workers, digits_test):
    """Plain torch's spread over three seeds bounds what two workers may reach: sync averages two batches a step (it
    should be at least as good as one process), async applies each alone, a step stale at most (as plain, within
    that spread)."""
    steps = 60

    def test_loss(model) -> float:
        return pscluster.evaluate.evaluate(model.eval(), digits_test, torch.nn.NLLLoss())["loss"]

    plain = [test_loss(mnist_plain.main(seed=s, steps=steps)) for s in (1, 2, 3)]
    spread = max(plain) - min(plain)
    for mode in ("sync", "async"):
        run = two_workers.run(mnist_pscluster.main, mode=mode, steps=steps, seed=1).wait(verbose=False)
        model = mnist_plain.Net()
        model.load_state_dict(run.state_dict())
        assert test_loss(model) <= max(plain) + spread, (mode, test_loss(model), plain)
        assert test_loss(model) < statistics.mean(plain) * 2


def gpt_val_loss(state: dict) -> float:
    """A GPT's validation loss over the same batches for every model compared."""
    model = gpt_plain.GPT()
    model.load_state_dict(state)
    torch.manual_seed(0)
    return gpt_plain.estimate_loss(model, eval_iters=8)


def gan_distance(netG_state: dict) -> float:
    """How far the generator's mean image (of fixed noise) is from the data's, as a root mean square over the
    pixels: 0.82 untrained, about 0.5 after 30 plain steps, 0.16 after 60 (a GAN has no loss that only falls)."""
    netG = gan_plain.Generator()
    netG.load_state_dict(netG_state)
    netG.eval()
    data = gan_plain.blobs(n=512, seed=1).tensors[0]
    with torch.no_grad():
        fake = netG(torch.randn(256, gan_plain.NZ, 1, 1, generator=torch.Generator().manual_seed(0)))
    return (fake.mean(0) - data.mean(0)).pow(2).mean().sqrt().item()


def test_a_gpt_and_a_gan_on_two_workers_sync_and_async_end_within_plain_torch_s_seed_spread(two_workers):
    """Two optimizers (the GAN's) and the GPT's loop on two workers, sync and async. Plain torch over three seeds
    gives the spread a run may land in: two workers in sync average two batches a step (no worse than one process),
    in async each push applies alone, a step stale at most (as plain, within that spread). The GPT is measured by
    its validation loss, the GAN by how far its generator's mean image is from the data's. A GAN's game suffers
    from stale steps more: in async each worker runs half the iterations, each on a model a step old, so it is
    bounded by plain torch run for half the steps (0.73-0.76 there, 0.47-0.55 at the full count, 0.66-0.68
    measured in async)."""
    gpt_steps, gan_steps, gpt_seeds, gan_seeds = 30, 30, (1337, 1338, 1339), (3, 4, 5)
    with threads(two_workers.threads):
        gpt_plain_losses = [gpt_val_loss(gpt_plain.main(seed=s, max_iters=gpt_steps)[0].state_dict())
                            for s in gpt_seeds]
        gan_plain_distances = {mode: [gan_distance(gan_plain.main(seed=s, steps=steps)[0].state_dict())
                                      for s in gan_seeds]
                               for mode, steps in (("sync", gan_steps), ("async", gan_steps // 2))}
    for mode in ("sync", "async"):
        run = two_workers.run(gpt_pscluster.main, mode=mode, steps=gpt_steps,
                              seed=gpt_seeds[0]).wait(verbose=False)
        spread = max(gpt_plain_losses) - min(gpt_plain_losses)
        assert gpt_val_loss(run.state_dict()) <= max(gpt_plain_losses) + spread, (mode, gpt_plain_losses)
        run = two_workers.run(gan_pscluster.main, mode=mode, steps=gan_steps, seed=gan_seeds[0]).wait(verbose=False)
        assert run.status == "finished" and run.global_step == gan_steps, (mode, run.error_line)
        # the discriminator's updates besides the global steps (the generator's), logged by both workers
        assert sum(s["applied"] for s in run.ps_stats) >= 2 * gan_steps
        metrics = run.metrics()
        assert set(metrics["worker"]) == {0, 1} and metrics[["loss_d", "loss_g"]].notna().all().all()
        got = gan_distance({k.removeprefix("Generator."): v for k, v in run.state_dict().items()
                            if k.startswith("Generator.")})
        plain = gan_plain_distances[mode]
        assert got <= max(plain) + max(plain) - min(plain), (mode, got, plain)


def test_what_a_loop_gets_wrong_is_one_line_before_any_worker_starts(one_worker):
    def no_optimizer(ctx):
        ctx.model(mlp())
        while not ctx.should_stop():
            pass

    def misses_a_parameter(ctx):
        model = ctx.model(mlp())
        ctx.optimizer(torch.optim.SGD(model[0].parameters(), lr=0.1))

    def fails_early(ctx):
        raise ValueError("no data here\nsecond line")

    def nan_lr(ctx):
        model = ctx.model(mlp())
        ctx.optimizer(torch.optim.SGD(model.parameters(), lr=float("nan")))
        ctx.should_stop()

    def never_trains(ctx):
        model = ctx.model(mlp())
        ctx.optimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    for train_fn, says in ((no_optimizer, "ctx.optimizer"), (misses_a_parameter, "2.weight is trainable"),
                           (fails_early, "ValueError: no data here"), (nan_lr, "lr=nan: give a finite number"),
                           (never_trains, "returned before its loop's first training call")):
        with pytest.raises(ConfigError, match=says) as e:
            one_worker.run(train_fn, steps=5)
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="unknown option 'batch_size'"):
        one_worker.run(record_random, steps=5, batch_size=3)
    with pytest.raises(ConfigError, match="optimizer option lr=nan: give a finite number"):
        one_worker.train(mlp, pscluster.datasets.digits("train"), torch.nn.CrossEntropyLoss(), lr=float("nan"), steps=5)
    assert one_worker.active_run is None


def test_a_session_steps_the_notebook_s_batches_as_one_process_steps_the_whole_batch(two_workers, digits_train):
    """Seed 004 in a notebook: each batch split across the workers, their gradients averaged by the ps tasks, is
    a plain SGD step on the whole batch; a ReduceLROnPlateau on session.optimizer changes the rate the ps applies."""
    batches = [batch for _, batch in zip(range(12), torch.utils.data.DataLoader(digits_train, batch_size=64))]
    loss_fn = torch.nn.CrossEntropyLoss()
    with two_workers.session(mlp, torch.optim.SGD, loss_fn, lr=0.2, momentum=0.5, seed=4) as session:
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(session.optimizer, factor=0.5, patience=0)
        outs = []
        for x, y in batches:
            outs.append(session.step((x, y)))
            plateau.step(1.0)  # no better than before from the second step on: the rate halves each step
        assert session.global_step == 12
        state = session.state_dict()
    assert session.run.status == "finished" and session.run.global_step == 12
    assert outs[0]["samples"] == 64 and "accuracy" in outs[0]

    torch.manual_seed(4)
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.5)
    plain_plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0)
    with threads(two_workers.threads):
        for (x, y), out in zip(batches, outs):
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            plain_plateau.step(1.0)
            assert out["loss"] == pytest.approx(loss.item(), abs=1e-5)
    assert max_diff(state, model.state_dict()) <= 1e-5
    with pytest.raises(pscluster.PSClusterError, match="is over"):
        session.step(batches[0])


def test_train_takes_parameter_groups_as_torch_builds_them(one_worker, digits_train):
    """Groups of tensors (of the module given as model_fn) train as the same groups by name."""
    torch.manual_seed(0)
    model = mlp()
    by_tensor = [{"params": [model[0].weight, model[2].weight], "weight_decay": 0.1},
                 {"params": [model[0].bias, model[2].bias], "weight_decay": 0.0}]
    by_name = [{"params": ["*.weight"], "weight_decay": 0.1}, {"params": ["*.bias"], "weight_decay": 0.0}]
    options = dict(optimizer="adamw", lr=0.01, steps=10, batch_size=16, seed=3)
    runs = [one_worker.train(model, digits_train, torch.nn.CrossEntropyLoss(), param_groups=groups,
                             **options).wait(verbose=False) for groups in (by_tensor, by_name)]
    assert max_diff(runs[0].state_dict(), runs[1].state_dict()) == 0
    with pytest.raises(ConfigError, match="group 0 params\\[0\\] .* no parameter of the model") as e:
        one_worker.train(mlp, digits_train, torch.nn.CrossEntropyLoss(), param_groups=by_tensor, **options)
    assert len(str(e.value)) < 200  # a function's model is not the module those tensors belong to
