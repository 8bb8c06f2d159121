from prefetchd.cli import main

main()
