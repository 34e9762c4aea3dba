"""Drivers: what runs a probe and produces traces -- in this process, one interpreter per
repeat, or on N ranks under torch.distributed.run."""
