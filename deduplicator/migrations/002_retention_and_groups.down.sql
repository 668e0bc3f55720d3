DROP TABLE IF EXISTS {{ident .Schema (print .Table "_group")}};
DROP TABLE IF EXISTS {{ident .Schema (print .Table "_setting")}};
