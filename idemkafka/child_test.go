package idemkafka_test

func runChildIfAsked() {}
