"""Developer tools, not installed with the package: the generators of the data the package ships
(run from the repository root, `python3 -m tools.make_<task>`, or as a script), and the local
multi-rank launcher of the tests, benchmarks and studies (launch_local.py)."""
