"""Tests across ranks: plan agreement, acknowledgements and the multi-GPU bench script."""
