from atoll.cli.commands import main

main()
