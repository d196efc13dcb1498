from rpeg.cli import run

run()
