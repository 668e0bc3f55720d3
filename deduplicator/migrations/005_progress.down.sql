DROP TABLE IF EXISTS {{ident .Schema (print .Table "_progress")}};
