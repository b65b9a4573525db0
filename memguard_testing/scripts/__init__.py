"""Training scripts that tests and benchmarks run as child processes, launched by path
(:func:`memguard_testing.script`); each imports its helpers from :mod:`memguard_testing`."""
