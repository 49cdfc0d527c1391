"""A pytorch/examples-style MNIST script, on the built-in 8x8 digits: a CNN with dropout, Adadelta, StepLR."""

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import optim
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader

import pscluster


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, 1)
        self.conv2 = nn.Conv2d(8, 16, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(64, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x.view(-1, 1, 8, 8)))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(self.dropout1(x), 1)
        x = self.dropout2(F.relu(self.fc1(x)))
        return F.log_softmax(self.fc2(x), dim=1)


def main(ctx, batch_size=32, lr=1.0, gamma=0.7, lr_step=20, log_interval=20):
    torch.manual_seed(ctx.seed)
    train_set = pscluster.datasets.digits("train")
    train_loader = ctx.shard(DataLoader(train_set, batch_size=batch_size, shuffle=True))
    model = ctx.model(Net())
    optimizer = ctx.optimizer(optim.Adadelta(model.parameters(), lr=lr))
    scheduler = StepLR(optimizer, step_size=lr_step, gamma=gamma)
    model.train()
    while not ctx.should_stop():
        for data, target in train_loader:
            optimizer.zero_grad()
            loss = F.nll_loss(model(data), target)
            loss.backward()
            optimizer.step()
            scheduler.step()
            ctx.log(loss=loss.item())
            if ctx.global_step % log_interval == 0:
                print(f"step {ctx.global_step} loss {loss.item():.6f}")
            if ctx.should_stop():
                break
