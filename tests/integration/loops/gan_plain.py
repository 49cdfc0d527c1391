"""A DCGAN-style GAN on small generated images (8x8 blobs): a generator and a discriminator with BatchNorm, each
with its own Adam, the discriminator stepped first on real and fake images, then the generator."""

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

NZ = 8


def blobs(n=512, seed=0):
    """8x8 images of one bright Gaussian blob each, in [-1, 1]."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.rand(n, 2, generator=g) * 5 + 1.5
    grid = torch.stack(torch.meshgrid(torch.arange(8.0), torch.arange(8.0), indexing="ij"), -1)
    images = torch.exp(-((grid[None] - centers[:, None, None]) ** 2).sum(-1) / 2.0)
    return TensorDataset(images[:, None] * 2 - 1)


class Generator(nn.Module):
    def __init__(self):
        super().__init__()
        self.main = nn.Sequential(nn.ConvTranspose2d(NZ, 16, 4, 1, 0, bias=False), nn.BatchNorm2d(16), nn.ReLU(True),
                                  nn.ConvTranspose2d(16, 1, 4, 2, 1, bias=False), nn.Tanh())

    def forward(self, z):
        return self.main(z)


class Discriminator(nn.Module):
    def __init__(self):
        super().__init__()
        self.main = nn.Sequential(nn.Conv2d(1, 16, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, inplace=True),
                                  nn.Conv2d(16, 32, 3, 1, 1, bias=False), nn.BatchNorm2d(32),
                                  nn.LeakyReLU(0.2, inplace=True), nn.Conv2d(32, 1, 4, 1, 0, bias=False), nn.Sigmoid())

    def forward(self, x):
        return self.main(x).view(-1)


def main(seed=3, steps=30, batch_size=32, lr=2e-3):
    torch.manual_seed(seed)
    dataset = blobs()
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=True)
    netG, netD = Generator(), Discriminator()
    criterion = nn.BCELoss()
    optimizerD = torch.optim.Adam(netD.parameters(), lr=lr, betas=(0.5, 0.999))
    optimizerG = torch.optim.Adam(netG.parameters(), lr=lr, betas=(0.5, 0.999))
    step, losses = 0, []
    while step < steps:
        for (real,) in loader:
            netD.zero_grad()
            label = torch.ones(real.size(0))
            errD_real = criterion(netD(real), label)
            errD_real.backward()
            fake = netG(torch.randn(real.size(0), NZ, 1, 1))
            errD_fake = criterion(netD(fake.detach()), label.fill_(0.0))
            errD_fake.backward()
            optimizerD.step()
            netG.zero_grad()
            errG = criterion(netD(fake), label.fill_(1.0))
            errG.backward()
            optimizerG.step()
            losses.append((errD_real + errD_fake).item())
            step += 1
            if step == steps:
                break
    return netG, netD, losses
