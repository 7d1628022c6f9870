from datamodules.downscale.writer import main

main()
