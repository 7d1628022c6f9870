from datamodules.shards.pack import main

main()
