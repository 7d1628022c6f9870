from datamodules.builtin.tree import main

main()
