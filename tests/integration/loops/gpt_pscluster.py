"""A character-level GPT trained in nanoGPT's style: AdamW with decay on the >= 2-D parameters only, the learning rate
set in param_groups every iteration (warmup, then cosine), micro-batches accumulated, gradients clipped, bf16 autocast,
an evaluation every few iterations that stops training early below a validation loss."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

TEXT = "".join(f"{a} plus {b} is {a + b}. " for a in range(12) for b in range(12))
CHARS = sorted(set(TEXT))
DATA = torch.tensor([CHARS.index(c) for c in TEXT])
TRAIN, VAL = DATA[: int(0.9 * len(DATA))], DATA[int(0.9 * len(DATA)):]


def get_batch(split, batch_size=8, block_size=16):
    data = TRAIN if split == "train" else VAL
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([data[i:i + block_size] for i in ix])
    y = torch.stack([data[i + 1:i + 1 + block_size] for i in ix])
    return x, y


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = nn.MultiheadAttention(n_embd, n_head, batch_first=True)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x):
        t = x.shape[1]
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool), 1)
        h = self.ln_1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size=len(CHARS), block_size=16, n_embd=32, n_head=2, n_layer=1):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.blocks = nn.Sequential(*[Block(n_embd, n_head) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.shape[1])
        x = self.blocks(self.wte(idx) + self.wpe(pos))
        logits = self.lm_head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate, betas):
        params = [p for p in self.parameters() if p.requires_grad]
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas)


def get_lr(it, learning_rate=3e-3, warmup_iters=10, lr_decay_iters=60, min_lr=3e-4):
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


@torch.no_grad()
def estimate_loss(model, eval_iters=4):
    model.eval()
    losses = torch.stack([model(*get_batch("val"))[1] for _ in range(eval_iters)])
    model.train()
    return losses.mean().item()


def main(ctx, eval_interval=10, stop_below=0.0, gradient_accumulation_steps=2, grad_clip=1.0):
    torch.manual_seed(ctx.seed)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    model = ctx.model(GPT())
    optimizer = ctx.optimizer(model.configure_optimizers(weight_decay=0.1, learning_rate=3e-3, betas=(0.9, 0.95)))
    iter_num, val_losses = 0, []
    X, Y = get_batch("train")
    while True:
        lr = get_lr(ctx.global_step)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        if ctx.global_step % eval_interval == 0 and ctx.is_chief:
            val_losses.append(estimate_loss(model))
            ctx.log(val_loss=val_losses[-1])
            if val_losses[-1] < stop_below:
                ctx.request_stop(f"validation loss {val_losses[-1]:.3f} < {stop_below}")
                break
        for micro_step in range(gradient_accumulation_steps):
            with autocast:
                logits, loss = model(X, Y)
                loss = loss / gradient_accumulation_steps
            X, Y = get_batch("train")
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if ctx.should_stop():
            break
    return model, val_losses
