from longreel.cli import console_main

if __name__ == "__main__":  # not when a multiprocessing spawn child imports the main module
    console_main()
