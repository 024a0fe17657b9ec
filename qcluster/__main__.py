from qcluster.cli import main

main()
