"""A probe file whose probe function raises."""

import torch


def probe(device):
    model = torch.nn.Linear(3, 3)
    return model.does_not_exist
