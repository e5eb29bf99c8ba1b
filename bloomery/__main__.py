from bloomery.cli import main

main()
