from longreel.cli import console_main

console_main()
