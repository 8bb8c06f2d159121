from prefetchd.daemon.cli import main

main()
