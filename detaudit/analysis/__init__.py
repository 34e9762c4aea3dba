"""Analysis of saved traces (torch-free): the run-to-run comparison, the cross-rank checks,
the diff of two runs, and the verdict."""
