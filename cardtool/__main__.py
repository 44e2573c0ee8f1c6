from cardtool.cli import main

main()
