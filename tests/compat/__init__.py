"""torch's own distributed RPC test suites, run against rpcdist.

torch ships the test classes of ``torch.distributed.rpc`` and friends in its wheel
(``torch/testing/_internal/distributed/...``), written against an abstract agent fixture
(``RpcAgentTestFixture``). torch runs them by mixing in a concrete fixture (TensorPipe's) and
its multi-process machinery (``MultiProcessTestCase``); this package does the same with an
rpcdist fixture, in worker processes where rpcdist's modules stand in for torch's::

    suites.py         the torch test classes that run here (one line each)
    substitution.py   the import hook: rpcdist under torch's module names, in the workers only
    fixture.py        RpcdistRpcAgentTestFixture, as torch's TensorPipeRpcAgentTestFixture
    launcher.py       SpawnHelper and generate_tests: the concrete classes, their worker processes
    worker.py         what every worker process has loaded before it starts (fork server preload)
    skips.py          the one reviewed list of tests that are not run, with their reasons
    probe.py          a suite written like torch's that checks the substitution from inside
    test_torch_suites.py   the generated test classes pytest runs
    test_substitution.py   proof that the calls go through rpcdist, and checks of the skip list
    report.py         `python tests/compat/report.py`: runs the suites, rewrites REPORT.md

The test assertions are torch's, unedited. The pytest process itself never installs the
substitution: it only starts the workers and reads their exit codes, as torch's runner does.
"""
