"""Multi-process tests: real torch.distributed (gloo) process groups via tests/harness.py.

A package, so these modules (named like their unit-test counterparts) import as dist.test_*.
"""
