from datamodules.lmdb.pack import main

main()
