from bunshinfork.workspace import Workspace


def test_create_run_destroy():
    with Workspace.create() as ws:
        r = ws.commands.run("echo hi; exit 3")
        assert (r.stdout, r.exit_code) == ("hi\n", 3)
