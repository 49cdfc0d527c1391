"""The models people bring, trained through ``cluster.train`` on real engines and compared with a plain torch loop
on the same data and steps: BatchNorm, frozen and tied parameters, tuple outputs, dict batches with two inputs,
a step_fn with its own metrics, an LSTM language model with clipping, a non-finite loss.

One worker in sync mode sees exactly the batches of the plain loop (same sampler order), so the whole state
(parameters and buffers) must agree within 1e-5; two ps tasks place the state across both."""

import html
import inspect
import math
import threading
import time

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import pscluster
from pscluster.errors import ConfigError, TrainingError
from pscluster.widgets.dashboard import Dashboard

from .conftest import events, wait_for_step

pytestmark = pytest.mark.integration
SEED, BATCH = 3, 32


# --- the models ------------------------------------------------------------------------------
class BNNet(nn.Module):
    """A small BatchNorm CNN for the 8x8 digits."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Unflatten(1, (1, 8, 8)), nn.Conv2d(1, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
            nn.MaxPool2d(2), nn.Conv2d(8, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Sequential(nn.Linear(16, 32, bias=False), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 10))

    def forward(self, x):
        return self.head(self.features(x))


def frozen_stem():
    """A pretrained-looking stem that stays fixed, and a head that trains."""
    model = nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 10))
    for p in model[0].parameters():
        p.requires_grad_(False)
    return model


class WithAux(nn.Module):
    """forward returns (logits, features): the loss uses both."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 32), nn.Tanh())
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        h = self.body(x)
        return self.head(h), h


def aux_loss(output, target):
    logits, features = output
    return F.cross_entropy(logits, target) + 0.01 * features.pow(2).mean()


class TwoInputs(nn.Module):
    """forward(pixels, stats): the image and per-row statistics of it, as a dict batch gives them."""

    def __init__(self):
        super().__init__()
        self.pixels = nn.Linear(64, 32)
        self.stats = nn.Linear(16, 32)
        self.out = nn.Linear(32, 10)

    def forward(self, pixels, stats):
        return self.out(torch.relu(self.pixels(pixels) + self.stats(stats)))


class DictDigits(Dataset):
    """The digits as ``({"pixels": x, "stats": row means and maxima}, label)``, or flat dicts with the label inside."""

    def __init__(self, split, flat=False):
        self.base, self.flat = pscluster.datasets.digits(split), flat

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        x, y = self.base[i]
        rows = x.view(8, 8)
        inputs = {"pixels": x, "stats": torch.cat([rows.mean(1), rows.amax(1)])}
        return {**inputs, "label": y} if self.flat else (inputs, y)


def dict_step(model, batch):
    """A step_fn for flat dict batches: the loss and two metrics of its own."""
    logits = model(batch["pixels"], batch["stats"])
    loss = F.cross_entropy(logits, batch["label"])
    return loss, {"error_rate": (logits.argmax(1) != batch["label"]).float().mean(), "logit_scale": logits.std()}


# --- plain torch, the reference ----------------------------------------------------------------
def plain_loop(model_fn, dataset, steps, *, optimizer=torch.optim.SGD, loss_fn=None, step_fn=None, clip=None,
               scheduler=None, batch=BATCH, collate_fn=None, device="cpu", precision="fp32", **options) -> nn.Module:
    """``steps`` steps of one process, batches in the order a single pscluster worker reads them, on one thread as
    the engines of these clusters compute (another thread count sums in another order). On ``device`` in
    ``precision``: bf16 / fp16 autocast (fp16 with torch's GradScaler), the gradients rounded to that dtype
    before the step, as a worker sends them (and DDP's bf16 compression hook would); the model is returned on
    the CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _plain_loop(model_fn, dataset, steps, optimizer, loss_fn, step_fn, clip, scheduler, batch, collate_fn,
                           torch.device(device), precision, options).cpu()
    finally:
        torch.set_num_threads(threads)


def _on(batch, device):
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: _on(v, device) for k, v in batch.items()}
    return type(batch)(_on(v, device) for v in batch) if isinstance(batch, (tuple, list)) else batch


def _plain_loop(model_fn, dataset, steps, optimizer, loss_fn, step_fn, clip, scheduler, batch, collate_fn, device,
                precision, options):
    torch.manual_seed(SEED)
    model = model_fn().to(device)
    dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    # torch's fused kernel where it has one, as the ps steps (it rounds differently from the per-tensor loop)
    fused = {"fused": True} if "fused" in inspect.signature(optimizer).parameters and "foreach" not in options else {}
    opt = optimizer([p for p in model.parameters() if p.requires_grad], **fused, **options)
    schedule = scheduler(opt) if scheduler else None
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=SEED)
    step, epoch = 0, 0
    while step < steps:
        sampler.set_epoch(epoch)
        for b in DataLoader(dataset, batch_size=batch, sampler=sampler, collate_fn=collate_fn):
            if step == steps:
                break
            opt.zero_grad()
            b = _on(b, device)
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                if step_fn is not None:
                    loss = step_fn(model, b)[0]
                else:
                    inputs, target = b
                    output = model(**inputs) if isinstance(inputs, dict) else model(inputs)
                    loss = loss_fn(output, target)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            if clip:
                nn.utils.clip_grad_norm_(model.parameters(), clip)
            if dtype is not None:
                for p in model.parameters():
                    if p.grad is not None:
                        p.grad = p.grad.to(dtype).to(p.dtype)
            scaler.step(opt)
            scaler.update()
            if schedule:
                schedule.step()
            step += 1
        epoch += 1
    return model


def accuracy(model, dataset) -> float:
    model.eval()
    with torch.no_grad():
        x, y = next(iter(DataLoader(dataset, batch_size=len(dataset))))
        out = model(**x) if isinstance(x, dict) else model(x)
        out = out[0] if isinstance(out, tuple) else out
        return (out.argmax(1) == y).float().mean().item()


def assert_same_state(got: dict, expected: dict, tol=1e-5):
    """Every key in torch's order, each tensor within ``tol``."""
    assert list(got) == list(expected), "the state_dict keys (and their order) differ from torch's"
    for k, v in expected.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert torch.allclose(got[k].double(), v.double(), atol=tol, rtol=0), \
            f"{k}: off by {(got[k].double() - v.double()).abs().max().item()}"


def assert_loads_strictly(model_fn, run, tmp_path) -> nn.Module:
    """run.state_dict(), run.export() and run.model() load with strict=True into a fresh model."""
    state = run.state_dict()
    fresh = model_fn()
    fresh.load_state_dict(state)  # strict: every key, no extra
    exported = torch.load(run.export(tmp_path / "model.pt"), weights_only=True)
    model_fn().load_state_dict(exported)
    assert list(exported) == list(state)
    for k in state:
        assert torch.equal(exported[k], state[k]), k
    return run.model()


@pytest.fixture(scope="module")
def cluster_2ps_1w(start_cluster):
    return start_cluster(ps=2, workers=1)


# --- the tests ---------------------------------------------------------------------------------
def test_a_batchnorm_cnn_trains_with_its_running_statistics(cluster_2ps_1w, digits_train, digits_test, tmp_path):
    steps, options = 200, dict(lr=0.02, momentum=0.9)
    run = cluster_2ps_1w.train(BNNet, digits_train, nn.CrossEntropyLoss(), optimizer="sgd", mode="sync",
                               steps=steps, batch_size=BATCH, seed=SEED, checkpoint_secs=None,
                               **options).wait(verbose=False)
    expected = plain_loop(BNNet, digits_train, steps, loss_fn=nn.CrossEntropyLoss(), **options)
    assert_same_state(run.state_dict(), expected.state_dict())
    assert run.state_dict()["features.2.num_batches_tracked"].item() == steps
    assert run.state_dict()["features.2.running_var"].sub(1).abs().max() > 0.01  # the statistics moved
    model = assert_loads_strictly(BNNet, run, tmp_path)
    got, want = accuracy(model, digits_test), accuracy(expected, digits_test)
    assert abs(got - want) <= 0.02 and got > 0.88
    assert run.evaluate(digits_test)["accuracy"] == pytest.approx(got)
    kinds = cluster_2ps_1w.store.placement(run.id).set_index("variable")["kind"]
    assert kinds["features.2.running_mean"] == "buffer" and kinds["head.0.weight"] == "param"
    assert {kinds[k] for k in kinds.index if "num_batches" in k} == {"buffer"}
    assert set(run.store.placement(run.id)["ps"]) == {0, 1}  # the state is spread over both ps


def wide_bn_mlp():
    """A BatchNorm MLP of 8.6 MB: on 2 ps, ps 0 gets the 8 MB middle layer (its push goes during backward over
    the socket), ps 1 the rest (a push too small for that: after backward)."""
    return nn.Sequential(nn.Linear(64, 1024, bias=False), nn.BatchNorm1d(1024), nn.ReLU(), nn.Linear(1024, 2048),
                         nn.ReLU(), nn.Linear(2048, 10))


def test_pushes_leaving_during_backward_over_the_socket_train_as_the_plain_loop(cluster_2ps_1w, digits_train):
    steps, options = 60, dict(lr=0.02, momentum=0.9)
    run = cluster_2ps_1w.train(wide_bn_mlp, digits_train, nn.CrossEntropyLoss(), optimizer="sgd", mode="sync",
                               steps=steps, batch_size=BATCH, seed=SEED, checkpoint_secs=None, shared_memory=False,
                               **options).wait(verbose=False)
    assert run.results[0]["overlapped_pushes"] == steps
    expected = plain_loop(wide_bn_mlp, digits_train, steps, loss_fn=nn.CrossEntropyLoss(), **options)
    assert_same_state(run.state_dict(), expected.state_dict())


def test_bf16_trains_the_batchnorm_cnn_as_well_as_fp32(cluster_2ps_1w, digits_train, digits_test):
    # annealed to 0, so the result does not hang on the rounding of the last steps (it does at a fixed rate)
    steps, options = 300, dict(lr=0.05, momentum=0.9)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR
    run = cluster_2ps_1w.train(BNNet, digits_train, nn.CrossEntropyLoss(), mode="sync", steps=steps,
                               batch_size=BATCH, seed=SEED, precision="bf16", scheduler=cosine,
                               scheduler_options={"T_max": steps}, checkpoint_secs=None,
                               shared_memory=False, **options).wait(verbose=False)  # over the socket: the wire
    fp32 = plain_loop(BNNet, digits_train, steps, loss_fn=nn.CrossEntropyLoss(), scheduler=lambda o: cosine(o, steps),
                      **options)
    state = run.state_dict()
    assert all(t.dtype == fp32.state_dict()[k].dtype for k, t in state.items())  # fp32 masters on the ps
    got = run.evaluate(digits_test)["accuracy"]
    assert abs(got - accuracy(fp32, digits_test)) <= 0.02
    # the gradients travelled as bf16: about half the bytes of an fp32 push per step
    sent = run.metrics()["bytes_sent"].median()
    trained = sum(t.numel() for k, t in BNNet().named_parameters())
    assert sent < 3 * trained  # fp32 gradients alone would be 4 bytes each


def test_a_lost_ps_rolls_back_the_buffers_with_the_variables(own_cluster, digits_train, digits_test, tmp_path):
    c = own_cluster(ps=2, workers=1)
    steps = 400
    run = c.train(BNNet, digits_train, nn.CrossEntropyLoss(), mode="sync", steps=steps, batch_size=BATCH, seed=SEED,
                  lr=0.02, momentum=0.9, checkpoint_every=50, checkpoint_secs=None)
    wait_for_step(run, 130)
    c.kill("ps:1")
    run.wait(timeout=240, verbose=False)
    assert run.status == "finished" and run.global_step == steps
    restored = events(run, "restored")["detail"].map(lambda d: d["step"]).tolist()
    assert len(restored) == 1 and restored[0] >= 130  # the newest state: the survivor's shard, a worker's copy
    state = run.state_dict()
    # one batch per global step: a count restored with the variables goes on from the checkpoint's step to the
    # target (restored at its initial 0, it would end short by the checkpoint's step). The rescued checkpoint
    # takes each ps's newest source: the lost ps's part, a worker's copy, may be a step behind the survivor's
    # (rescue.assemble), and its counts with it
    for k in ("features.2.num_batches_tracked", "features.6.num_batches_tracked", "head.1.num_batches_tracked"):
        assert abs(state[k].item() - steps) <= 1, k
    model = assert_loads_strictly(BNNet, run, tmp_path)
    assert accuracy(model, digits_test) > 0.85


@pytest.mark.parametrize("optimizer, options", [
    ("sgd", dict(lr=0.05, momentum=0.9, weight_decay=1e-3)),
    ("adamw", dict(lr=3e-3, weight_decay=0.05)),
], ids=["sgd-momentum-decay", "adamw"])
def test_frozen_parameters_never_move(cluster_2ps_1w, digits_train, digits_test, tmp_path, optimizer, options):
    steps = 120
    run = cluster_2ps_1w.train(frozen_stem, digits_train, nn.CrossEntropyLoss(), optimizer=optimizer, mode="sync",
                               steps=steps, batch_size=BATCH, seed=SEED, checkpoint_secs=None,
                               **options).wait(verbose=False)
    cls = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}[optimizer]
    expected = plain_loop(frozen_stem, digits_train, steps, optimizer=cls, loss_fn=nn.CrossEntropyLoss(), **options)
    torch.manual_seed(SEED)
    initial = frozen_stem().state_dict()
    state = run.state_dict()
    for k in ("0.weight", "0.bias"):
        assert torch.equal(state[k], initial[k]), f"{k} moved"  # bit-identical
    assert not torch.equal(state["2.weight"], initial["2.weight"])
    assert_same_state(state, expected.state_dict())
    assert_loads_strictly(frozen_stem, run, tmp_path)
    assert abs(run.evaluate(digits_test)["accuracy"] - accuracy(expected, digits_test)) <= 0.02
    assert "0.weight: /job:ps/task:0 (frozen)" in cluster_2ps_1w.placement()


def test_a_model_returning_logits_and_features(cluster_2ps_1w, digits_train, digits_test):
    steps = 100
    run = cluster_2ps_1w.train(WithAux, digits_train, aux_loss, mode="sync", steps=steps, batch_size=BATCH,
                               seed=SEED, lr=0.2, log_every=50, checkpoint_secs=None).wait(verbose=False)
    expected = plain_loop(WithAux, digits_train, steps, loss_fn=aux_loss, lr=0.2)
    assert_same_state(run.state_dict(), expected.state_dict())
    assert run.results[0]["final_accuracy"] is not None  # the logits, first of the tuple
    result = run.evaluate(digits_test)
    assert result["accuracy"] == pytest.approx(accuracy(expected, digits_test))
    assert any("accuracy" in line for line in run.logs)


def test_a_dict_batch_feeds_a_model_with_two_inputs(cluster_2ps_1w, digits_test):
    steps, train = 100, DictDigits("train")
    run = cluster_2ps_1w.train(TwoInputs, train, nn.CrossEntropyLoss(), mode="sync", steps=steps,
                               batch_size=BATCH, seed=SEED, lr=0.2, checkpoint_secs=None).wait(verbose=False)
    expected = plain_loop(TwoInputs, train, steps, loss_fn=nn.CrossEntropyLoss(), lr=0.2)
    assert_same_state(run.state_dict(), expected.state_dict())
    test = DictDigits("test")
    assert abs(run.evaluate(test)["accuracy"] - accuracy(expected, test)) <= 1e-6


def test_a_step_fn_with_metrics_of_its_own(cluster_2ps_1w):
    steps, train, test = 100, DictDigits("train", flat=True), DictDigits("test", flat=True)
    run = cluster_2ps_1w.train(TwoInputs, train, step_fn=dict_step, mode="sync", steps=steps, batch_size=BATCH,
                               seed=SEED, lr=0.2, log_every=50, test_dataset=test, eval_every=50,
                               checkpoint_secs=None).wait(verbose=False)
    expected = plain_loop(TwoInputs, train, steps, step_fn=dict_step, lr=0.2)
    assert_same_state(run.state_dict(), expected.state_dict())
    metrics = run.metrics()
    assert {"error_rate", "logit_scale"} <= set(metrics.columns) and metrics["error_rate"].notna().all()
    assert metrics["accuracy"].isna().all()  # nothing to compute it from: left out, no crash
    assert metrics["error_rate"].iloc[-10:].mean() < metrics["error_rate"].iloc[:10].mean()
    assert any("error_rate" in line for line in run.logs)
    result = run.evaluate(test)
    assert 0 <= result["error_rate"] < 0.3 and result["accuracy"] is None


def test_a_batch_the_default_step_cannot_take_is_refused_at_train(cluster_2ps_1w):
    with pytest.raises(ConfigError, match=r"a batch of the dataset is a dict\(pixels, stats, label\): the default "
                                          r"step takes \(inputs, target\) batches; give step_fn="):
        cluster_2ps_1w.train(TwoInputs, DictDigits("train", flat=True), nn.CrossEntropyLoss(), steps=10)
    with pytest.raises(ConfigError, match=r"the training step fails on a batch of the dataset \(tuple of 2\): "
                                          r"TypeError: .*forward\(\) missing 1 required positional argument"):
        cluster_2ps_1w.train(TwoInputs, pscluster.datasets.digits("train"), nn.CrossEntropyLoss(), steps=10)
    assert cluster_2ps_1w.active_run is None


def test_a_misspelt_option_or_a_loss_class_is_refused_at_train_naming_the_fix(cluster_2ps_1w, digits_train):
    with pytest.raises(ConfigError, match=r"^train\(\) got unknown option 'stpes', neither its own nor SGD's: did "
                                          r"you mean 'steps'\?$"):
        cluster_2ps_1w.train(frozen_stem, digits_train, nn.CrossEntropyLoss(), stpes=20)
    with pytest.raises(ConfigError, match=r"^train\(\) got unknown option 'momentun', neither its own nor Adam's: "
                                          r"use one of Adam's: lr, betas, "):  # Adam has no momentum
        cluster_2ps_1w.train(frozen_stem, digits_train, nn.CrossEntropyLoss(), optimizer="adam", momentun=0.9)
    with pytest.raises(ConfigError, match=r"^loss_fn=CrossEntropyLoss is a class: pass an instance, "
                                          r"loss_fn=CrossEntropyLoss\(\)$"):
        cluster_2ps_1w.train(frozen_stem, digits_train, nn.CrossEntropyLoss, steps=20)
    assert cluster_2ps_1w.active_run is None


# --- the input pipeline: a DataLoader with loader processes, an IterableDataset ---------------------
def features(items):
    """A collate_fn that builds the two inputs of TwoInputs from (image, label) items, as a loader would."""
    x = torch.stack([x for x, _ in items])
    rows = x.view(-1, 8, 8)
    return {"pixels": x, "stats": torch.cat([rows.mean(2), rows.amax(2)], 1)}, torch.stack([y for _, y in items])


def test_a_dataloader_with_loader_processes_and_a_collate_fn(cluster_2ps_1w, digits_train):
    steps = 100
    loader = DataLoader(digits_train, batch_size=BATCH, shuffle=True, num_workers=2, prefetch_factor=3,
                        collate_fn=features)
    run = cluster_2ps_1w.train(TwoInputs, loader, nn.CrossEntropyLoss(), mode="sync", steps=steps, seed=SEED,
                               lr=0.2, checkpoint_secs=None).wait(verbose=False)
    assert run.plan.batch_size == BATCH and run.plan.loader.num_workers == 2 and run.plan.loader.prefetch_factor == 3
    expected = plain_loop(TwoInputs, digits_train, steps, loss_fn=nn.CrossEntropyLoss(), collate_fn=features,
                          lr=0.2)
    assert_same_state(run.state_dict(), expected.state_dict())  # the same batches, in the same order
    assert run.evaluate(pscluster.datasets.digits("test"))["accuracy"] > 0.85  # collated as the workers did
    with pytest.raises(ConfigError, match="a WeightedRandomSampler cannot be split across workers"):
        cluster_2ps_1w.train(TwoInputs, DataLoader(digits_train, batch_size=8, sampler=torch.utils.data.
                                                   WeightedRandomSampler([1.0] * len(digits_train), 100)),
                             nn.CrossEntropyLoss())


class DigitStream(torch.utils.data.IterableDataset):
    """The training digits as a stream (e.g. records read from files), in a fixed shuffled order."""

    def __iter__(self):
        base = pscluster.datasets.digits("train")
        for i in torch.randperm(len(base), generator=torch.Generator().manual_seed(0)).tolist():
            yield base[i]


def test_an_iterable_dataset_read_in_parts_by_workers_and_loader_processes(start_cluster, digits_test):
    cluster = start_cluster(ps=1, workers=2)
    steps, mlp = 150, lambda: nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    run = cluster.train(mlp, DigitStream(), nn.CrossEntropyLoss(), mode="sync", steps=steps, batch_size=BATCH,
                        seed=SEED, lr=0.2, loader_workers=2, checkpoint_secs=None).wait(verbose=False)
    assert run.global_step == steps and run.local_steps == [steps, steps]
    plain = plain_loop(mlp, list(DigitStream()), steps, loss_fn=nn.CrossEntropyLoss(), batch=2 * BATCH, lr=0.2)
    got = run.evaluate(digits_test)["accuracy"]
    assert got > 0.85 and abs(got - accuracy(plain, digits_test)) <= 0.03


# --- a language model: tied weights, LSTM, clipping ---------------------------------------------
VOCAB, SEQ = 40, 12


class Corpus(Dataset):
    """Token windows of a text drawn from a fixed random Markov chain: (tokens, next tokens)."""

    def __init__(self, split, windows=600):
        g = torch.Generator().manual_seed(11)
        transitions = torch.softmax(torch.randn(VOCAB, VOCAB, generator=g) * 3, 1)
        g.manual_seed(12 if split == "train" else 13)
        text = [0]
        for _ in range(windows * SEQ + 1):
            text.append(int(torch.multinomial(transitions[text[-1]], 1, generator=g)))
        self.text = torch.tensor(text)

    def __len__(self):
        return (len(self.text) - 1) // SEQ

    def __getitem__(self, i):
        chunk = self.text[i * SEQ:(i + 1) * SEQ + 1]
        return chunk[:-1], chunk[1:]


class TiedLM(nn.Module):
    """pytorch/examples' word_language_model, small: embedding, 2-layer LSTM, decoder tied to the embedding."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Embedding(VOCAB, 24)
        self.rnn = nn.LSTM(24, 24, num_layers=2, batch_first=True, dropout=0.0)
        self.decoder = nn.Linear(24, VOCAB)
        self.decoder.weight = self.encoder.weight  # tie_weights

    def forward(self, tokens):
        out, _ = self.rnn(self.encoder(tokens))
        return self.decoder(out)


def lm_loss(output, target):
    return F.cross_entropy(output.reshape(-1, VOCAB), target.reshape(-1))


def test_a_tied_lstm_language_model_with_clipping_and_a_step_schedule(cluster_2ps_1w, tmp_path):
    steps, train, test = 120, Corpus("train"), Corpus("test", windows=100)
    run = cluster_2ps_1w.train(TiedLM, train, lm_loss, mode="sync", steps=steps, batch_size=16, seed=SEED,
                               lr=1.0, max_grad_norm=0.25, scheduler=torch.optim.lr_scheduler.StepLR,
                               scheduler_options={"step_size": 40, "gamma": 0.5},
                               checkpoint_secs=None).wait(verbose=False)
    expected = plain_loop(TiedLM, train, steps, loss_fn=lm_loss, clip=0.25, batch=16, lr=1.0,
                          scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=40, gamma=0.5))
    state = run.state_dict()
    assert "decoder.weight" in state and state["decoder.weight"] is state["encoder.weight"]
    assert_same_state(state, expected.state_dict())
    model = assert_loads_strictly(TiedLM, run, tmp_path)
    assert model.decoder.weight is model.encoder.weight  # still tied
    got = run.evaluate(test)
    assert got["accuracy"] is not None  # next-token accuracy: (N, T, C) logits against (N, T) tokens
    with torch.no_grad():
        x, y = next(iter(DataLoader(test, batch_size=len(test))))
        want = lm_loss(expected.eval()(x), y).item()
    assert abs(got["loss"] - want) <= 0.02 and got["loss"] < math.log(VOCAB) - 0.3  # it learned something
    rates = cluster_2ps_1w.store.ps_metrics(run.id)["lr"]  # the learning rate the ps tasks applied, logged
    assert set(rates) <= {1.0, 0.5, 0.25} and rates.iloc[-1] == 0.25


class ClippedSGD(torch.optim.SGD):
    """An optimizer of the notebook's own: SGD that keeps every parameter within [-0.5, 0.5]."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                p.clamp_(-0.5, 0.5)
        return loss


def warmup(step, length=20):
    return min(1.0, (step + 1) / length)


def test_an_optimizer_class_and_a_warmup_of_the_notebooks_own_with_parameter_groups(cluster_2ps_1w, digits_train):
    steps, options = 60, dict(lr=0.3, momentum=0.9, weight_decay=0.01)
    groups = [{"params": ["*.bias"], "weight_decay": 0.0}]
    run = cluster_2ps_1w.train(WithAux, digits_train, aux_loss, optimizer=ClippedSGD, param_groups=groups,
                               scheduler=warmup, scheduler_options={"length": 30}, mode="sync", steps=steps,
                               batch_size=BATCH, seed=SEED, checkpoint_secs=None, **options).wait(verbose=False)

    def grouped(params, **kwargs):  # torch's own param groups, built as the pattern says
        params = list(params)
        biases = [p for p in params if p.dim() == 1]
        return ClippedSGD([{"params": biases, "weight_decay": 0.0},
                           {"params": [p for p in params if p.dim() != 1]}], fused=True, **kwargs)

    expected = plain_loop(WithAux, digits_train, steps, optimizer=grouped, loss_fn=aux_loss,
                          scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: warmup(s, 30)),
                          **options)
    assert_same_state(run.state_dict(), expected.state_dict())
    assert max(t.abs().max().item() for t in run.state_dict().values()) <= 0.5  # the notebook's class stepped
    rates = cluster_2ps_1w.store.ps_metrics(run.id)["lr"]
    assert rates.iloc[-1] == pytest.approx(0.3)  # (the warmup itself shows in the state: the same as torch's)


def test_optimizer_options_torch_refuses_fail_at_train(cluster_2ps_1w, digits_train):
    with pytest.raises(ConfigError, match=r"optimizer SGD refused momentum=-0.5: Invalid momentum value: -0.5 — "
                                          r"pass the optimizer's own options"):  # a misspelt name: test_a_misspelt_option_...
        cluster_2ps_1w.train(WithAux, digits_train, aux_loss, optimizer="SGD", lr=0.1, momentum=-0.5)
    with pytest.raises(ConfigError, match=r"group 0 pattern '\*\.bais' matches no trainable parameter"):
        cluster_2ps_1w.train(WithAux, digits_train, aux_loss, lr=0.1, param_groups=[{"params": ["*.bais"]}])
    assert cluster_2ps_1w.active_run is None


# --- failures say what happened -------------------------------------------------------------------
class Poisoned(Dataset):
    """The digits with one sample turned to NaN (or, given ``scale``, multiplied by it): the batch holding it has a
    NaN loss (or a finite one with huge gradients)."""

    def __init__(self, bad_index, scale=None):
        self.base, self.bad, self.scale = pscluster.datasets.digits("train"), bad_index, scale

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        x, y = self.base[i]
        if i != self.bad:
            return x, y
        return (torch.full_like(x, float("nan")) if self.scale is None else x * self.scale), y


def first_batch_holding(dataset, index, batch=BATCH) -> int:
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=SEED)
    sampler.set_epoch(0)
    return list(sampler).index(index) // batch


def test_a_nan_loss_fails_the_run_at_that_step_and_keeps_what_was_trained(cluster_2ps_1w):
    data = Poisoned(bad_index=700)
    bad_step = first_batch_holding(data, 700)
    assert 5 < bad_step < 40
    run = cluster_2ps_1w.train(frozen_stem, data, nn.CrossEntropyLoss(), mode="sync", steps=60, batch_size=BATCH,
                               seed=SEED, lr=0.1, checkpoint_secs=None)
    seen = set()

    def watch():
        while not run.done:
            seen.add(run.status)
            time.sleep(0.001)

    watcher = threading.Thread(target=watch)
    watcher.start()
    with pytest.raises(TrainingError) as failure:
        run.wait(timeout=120, verbose=False)
    watcher.join()
    line = str(failure.value)
    assert "\n" not in line and run.status == "failed"
    assert "finished" not in seen  # not even while the run ends
    assert f"worker 0 failed: NonFiniteError: worker 0 computed a non-finite loss nan at global step {bad_step}" in line
    assert "on_nonfinite='skip'" in line and "(at steps.py:" in line  # the last frame of the traceback
    assert "Traceback" in run.error and "NonFiniteError" in run.error and "GradientRules.passes" in run.error
    # the cause, where it failed and the traceback: in the run store, pscluster.runs(), the run's final dashboard
    assert run.failure == {"cause": line, "task": "worker:0", "step": bad_step, "traceback": run.error}
    assert run.store.run(run.id)["failure"] == run.failure
    assert pscluster.runs(run.store.path).set_index("id").loc[run.id, "cause"] == line
    dashboard = Dashboard(run.store.path, run.id)
    dashboard.refresh()
    page = dashboard.static_html()
    dashboard.close()
    assert f"<b>failed on worker:0 at global step {bad_step}:</b> {html.escape(line)}" in page
    assert "<details><summary>traceback</summary>" in page and html.escape("GradientRules.passes") in page
    assert f"<th style='text-align:left'>cause</th><td style='text-align:left'>{html.escape(line)}</td>" in \
        run._repr_html_()
    state = run.state_dict()  # the last good parameters: those of the plain loop after bad_step steps
    expected = plain_loop(frozen_stem, pscluster.datasets.digits("train"), bad_step, loss_fn=nn.CrossEntropyLoss(),
                          lr=0.1)
    assert_same_state(state, expected.state_dict())
    assert run.evaluate(pscluster.datasets.digits("test"))["accuracy"] > 0.1


def test_an_update_that_would_overflow_is_refused_by_the_ps_and_what_was_trained_stays(cluster_2ps_1w):
    """A sample -1e25 times as large (its class then predicted wrong): the loss and gradients stay finite, Adam's
    squared gradient would not. The ps refuses that update whole; the run fails with the cause and keeps the
    parameters of the step before."""
    data = Poisoned(bad_index=700, scale=-1e25)
    bad_step = first_batch_holding(data, 700)
    trained_on_ps0 = {"2.weight": 0, "2.bias": 0, "0.weight": 1, "0.bias": 1}  # one ps refuses the whole step
    run = cluster_2ps_1w.train(frozen_stem, data, nn.CrossEntropyLoss(), mode="sync", steps=60, batch_size=BATCH,
                               seed=SEED, optimizer="adam", lr=0.01, placement=trained_on_ps0, checkpoint_secs=None)
    with pytest.raises(TrainingError) as failure:
        run.wait(timeout=120, verbose=False)
    line = str(failure.value)
    assert run.status == "failed" and "\n" not in line
    assert f"ps 0 refused the update from global step {bad_step}: the optimizer slot 'exp_avg_sq'" in line, line
    assert "nothing of it was applied" in line
    expected = plain_loop(frozen_stem, pscluster.datasets.digits("train"), bad_step, optimizer=torch.optim.Adam,
                          loss_fn=nn.CrossEntropyLoss(), lr=0.01)
    assert_same_state(run.state_dict(), expected.state_dict())


def test_a_nan_loss_can_skip_its_batch(cluster_2ps_1w):
    run = cluster_2ps_1w.train(frozen_stem, Poisoned(bad_index=700), nn.CrossEntropyLoss(), mode="sync", steps=40,
                               batch_size=BATCH, seed=SEED, lr=0.1, on_nonfinite="skip",
                               checkpoint_secs=None).wait(verbose=False)
    assert run.status == "finished" and run.global_step == 40  # within the first epoch: one bad batch
    assert run.results[0]["skipped"] == 1
    assert all(torch.isfinite(t).all() for t in run.state_dict().values())
    skipped = run.events()[run.events()["kind"] == "nonfinite"]
    assert len(skipped) == 1 and skipped["detail"].iloc[0]["problem"] == "loss nan"
