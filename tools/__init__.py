"""Developer tools: the generators of the data the package ships (run from the repository root,
`python3 -m tools.make_<task>`, or as a script). Not installed with the package."""
