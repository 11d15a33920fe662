"""MLP block of ``charlm``, imported with ``from .layers import Block``."""

from torch import nn


class Block(nn.Module):
    def __init__(self, hidden_size, act):
        super().__init__()
        self.fc_in = nn.Linear(hidden_size, 2 * hidden_size, bias=False)
        self.fc_out = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.act = act

    def forward(self, x):
        return self.fc_out(self.act(self.fc_in(x)))
