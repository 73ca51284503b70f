from memcalc.docgen import main

main()
