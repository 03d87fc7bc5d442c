from crosspool.cli import main

main()
